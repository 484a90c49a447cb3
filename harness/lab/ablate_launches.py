"""What the graphed AR and drafter-only steps of the qwen3-8b preset would cost without the RMSNorm launches or
the attention launches (replaced by no-ops: numerically wrong, same shapes), with PDL off and on: upper bounds on
what fusing them away could save. Random weights / scripted acceptance; CUDA only.

    PYTHONPATH=. python harness/lab/ablate_launches.py

Its numbers in NOTES.md were measured at f0e3d68, when PDL also applied to one-row launches."""
from harness.decode import kernels
from harness.lab.bench_step import _gen, _prompt
from harness.decode.devices import resolve_backend
from harness.decode.loop import DecodeSettings
from harness.protocol.presets import build_random
from harness.decode.timing import StageTimer

REAL_NORM, REAL_ATTN = kernels.rms_norm, kernels.attention


def no_norm(x, w, eps):
    return x


def no_attn(qkv, qn, kn, eps, cos, sin, positions, kc, vc, n_q, scale, causal=True, **kw):
    return qkv[:, : n_q * kc.shape[-1]]


def run(m, prompt, settings, label, norm, attn, pdl):
    """Median over three captures of the graphed step's median device ms, for AR and drafter-only."""
    kernels.set_launch(pdl=pdl, prefetch_tiles=1)
    kernels.rms_norm, kernels.attention = norm, attn
    out = []
    for method in ("ar", "drafter-only"):
        vals = []
        for _ in range(3):
            m.use_kernels(kernels)
            _gen(m, method, 0, 0, prompt, settings)
            t = StageTimer(m.backend.device)
            _gen(m, method, 0, 0, prompt, settings, mark=t)
            vals.append(t.summary()["step"])
        out.append(sorted(vals)[1])
    print(f"{label:40s} AR {out[0]:.3f}  drafter-only {out[1]:.3f}", flush=True)


def main():
    b = resolve_backend("cuda", "bfloat16")
    m = build_random("qwen3-8b", b, block_size=16, capacity=256)
    prompt = _prompt(128, m.target.vocab_size)
    settings = DecodeSettings(64, 4096, (), scripted_accept=3, graph_bucket=256, use_graph=True)
    for pdl in (False, None):
        run(m, prompt, settings, f"pdl={pdl} all", REAL_NORM, REAL_ATTN, pdl)
        run(m, prompt, settings, f"pdl={pdl} no norms", no_norm, REAL_ATTN, pdl)
        run(m, prompt, settings, f"pdl={pdl} no attention", REAL_NORM, no_attn, pdl)
        run(m, prompt, settings, f"pdl={pdl} neither", no_norm, no_attn, pdl)
    kernels.rms_norm, kernels.attention = REAL_NORM, REAL_ATTN


if __name__ == "__main__":
    main()
