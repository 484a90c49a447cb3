"""What the graphed AR and drafter-only steps of the qwen3-8b preset would cost without the RMSNorm launches or
the attention launches (replaced by no-ops: numerically wrong, same shapes), with PDL off and on: upper bounds on
what fusing them away could save. Random weights / scripted acceptance; CUDA only.

    python -m harness.lab.ablate_launches

The ablations are Ops subclasses (core.ops): the models run whatever ops they are given. Its numbers in
NOTES.md were measured at f0e3d68, when PDL also applied to one-row launches."""
from core.devices import resolve_backend
from core.errors import Parser, UsageError, cli_exit
from core.kernels import Launch
from harness.decode.loop import DecodeSettings
from core.ops.triton_impl import TritonOps
from harness.decode.timing import StageTimer
from harness.lab.bench_step import _gen, _prompt
from harness.protocol.presets import build_random


class Ablated(TritonOps):
    """The Triton ops with the norm launches and/or the attention launches replaced by no-ops."""

    def __init__(self, device, launch, norms: bool, attention: bool):
        super().__init__(device, launch)
        self.norms, self.attn = norms, attention

    def rms_norm(self, x, weight, eps):
        return super().rms_norm(x, weight, eps) if self.norms else x

    def linear(self, x, w, *, norm=None, **kw):
        if norm is not None and not self.norms:
            norm = None
        return super().linear(x, w, norm=norm, **kw)

    def attention(self, qkv, kv, layer, span, cos, sin, n_q, scale, *args, **kw):
        if self.attn:
            return super().attention(qkv, kv, layer, span, cos, sin, n_q, scale, *args, **kw)
        return qkv[:, : n_q * kv.head_dim]


def run(m, prompt, settings, label, ops):
    """Median over three captures of the graphed step's median device ms, for AR and drafter-only."""
    out = []
    for method in ("ar", "drafter-only"):
        vals = []
        for _ in range(3):
            m.use_ops(ops)
            _gen(m, method, 0, 0, prompt, settings)
            t = StageTimer(m.backend.device)
            _gen(m, method, 0, 0, prompt, settings, mark=t)
            vals.append(t.summary()["step"])
        out.append(sorted(vals)[1])
    print(f"{label:40s} AR {out[0]:.3f}  drafter-only {out[1]:.3f}", flush=True)


def main(argv=None) -> int:
    Parser(prog="python -m harness.lab.ablate_launches", description=__doc__.split("\n\n")[0]).parse_args(argv)
    return cli_exit(_ablate)


def _ablate():
    import torch
    if not torch.cuda.is_available():
        raise UsageError("ablate_launches times CUDA graphs of the Triton kernels at Qwen3-8B's shape: run it on a "
                         "CUDA GPU (it has no CPU mode)")
    b = resolve_backend("cuda", "bfloat16")
    m = build_random("qwen3-8b", b, block_size=16, capacity=256)
    prompt = _prompt(128, m.target.vocab_size)
    settings = DecodeSettings(64, 4096, (), scripted_accept=3, graph_bucket=256, use_graph=True)
    for pdl in (False, None):
        launch = Launch(pdl=pdl)
        for label, norms, attn in (("all", True, True), ("no norms", False, True), ("no attention", True, False),
                                   ("neither", False, False)):
            run(m, prompt, settings, f"pdl={pdl} {label}", Ablated(b.device, launch, norms, attn))


if __name__ == "__main__":
    raise SystemExit(main())
