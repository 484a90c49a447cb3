"""The names of the random-weights presets (harness.protocol.presets), importable without torch: --help lists
them and must not wait for torch. presets.PRESETS holds exactly these keys, in this order (a test checks it)."""
RANDOM_PRESETS = ("qwen3-8b", "smollm2-135m", "gemma4-26b-a4b", "gemma4-tiny", "tiny")
