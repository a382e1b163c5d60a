"""Q4_K's parameters packed as the file packs them (6-bit sc and m, 16 bytes a channel and
super-block) against the unpacked affine form (a byte each and a center byte, 21), on the real
layers of a GGUF file, in one process with one kernel build: the packed form reads 3.5% fewer
bytes of a Q4_K layer but unpacks its scales with a few more instructions a group, so it is
timed at decode (1 row), batched decode (16, 48) and prefill (512) row counts.

    python benchmarks/kparams_form.py [--model qwen2.5-coder-1.5b-instruct] [--rows 1 16 48 512]

Every packed Q4_K layer (`scale_tiles` of 256 bytes) of the first --layers decoder layers, both
forms on the same quads and x, alternating (and which goes first), median of --reps passes;
the outputs are checked equal first (the same float32 s and l0 per group). The CPU heads the
output.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve import LLM
from pagedserve.cpp_build import cpu_description
from pagedserve.quantization import gemv
from pagedserve.quantization.gguf_blocks import PACKED_SUPER_BYTES, _unpack_six_bit_planes


def affine_form(packed: torch.Tensor) -> torch.Tensor:
    """Packed parameters -> the affine form's bytes: d, dmin, center 0, then per group sc[16], m[16]."""
    tiles, supers, _ = packed.shape
    sc = _unpack_six_bit_planes(packed[..., 64:160])  # (T, S, 8, 16)
    m = _unpack_six_bit_planes(packed[..., 160:])
    pairs = torch.stack((sc, m), dim=3).reshape(tiles, supers, 8 * 2 * 16)
    center = torch.zeros(tiles, supers, 16, dtype=torch.uint8)
    return torch.cat((packed[..., :64], center, pairs), dim=-1).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 48, 512])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_description())
    llm = LLM(args.model, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    layers = []
    for layer in llm.llm_engine.runner.model.model.layers[: args.layers]:
        for module in layer.modules():
            params = getattr(module, "scale_tiles", None)
            quads = getattr(module, "qweight_quads", None)
            if quads is not None and params is not None and params.shape[-1] == PACKED_SUPER_BYTES:
                layers.append((quads, params, affine_form(params)))
    print(f"{len(layers)} packed Q4_K layers, {sum(q.numel() + p.numel() for q, p, _ in layers) / 2**20:.1f} MiB "
          f"packed vs {sum(q.numel() + a.numel() for q, _, a in layers) / 2**20:.1f} MiB affine")
    gen = torch.Generator().manual_seed(0)
    print("| rows | packed (ms) | affine (ms) | affine / packed |")
    print("|---:|---:|---:|---:|")
    for rows in args.rows:
        xs = [torch.randn(rows, q.shape[1] * 32, generator=gen) for q, _, _ in layers]

        def run(form: int, xs: list[torch.Tensor] = xs) -> list[torch.Tensor]:
            return [gemv.bits_q8(x, q, forms[form], None) for x, (q, *forms) in zip(xs, layers, strict=True)]

        for a, b in zip(run(0), run(1), strict=True):
            assert torch.equal(a, b), "the two forms must give the same sums"
        times: list[list[float]] = [[], []]
        for rep in range(args.reps):
            for form in ((0, 1) if rep % 2 == 0 else (1, 0)):
                start = time.perf_counter()
                run(form)
                times[form].append(time.perf_counter() - start)
        packed, affine = (statistics.median(t) * 1e3 for t in times)
        print(f"| {rows} | {packed:.2f} | {affine:.2f} | {affine / packed:.3f}x |")


if __name__ == "__main__":
    main()
