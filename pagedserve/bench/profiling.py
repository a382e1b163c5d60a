"""torch.profiler helpers shared by benchmarks/decode_profile.py and throughput_profile.py:
which recorded ops are top level (so nothing is counted twice), what kind each is, and
which linear op is the LM head."""

from __future__ import annotations

LINEAR_OPS = ("gemv", "linear", "mkldnn", "addmm", "mm")
CATEGORIES = {  # other top-level ops, by the name after "namespace::"; the first match counts
    "attention": ("attention", "reshape_and_cache", "sdpa", "scaled_dot"),
    "norms/rope/act": ("rms", "norm", "rotary", "silu", "gelu", "mul", "add", "rsqrt", "pow", "mean"),
}


def category(name: str) -> str:
    op = name.rsplit("::", 1)[-1].lower()
    return next((c for c, keys in CATEGORIES.items() if any(k in op for k in keys)), "the rest")


def top_level(events: list) -> list:
    """Events not nested in another op event (by time interval, per thread)."""
    ops = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: (e.time_range.start, -e.time_range.end))
    out: list = []
    end_by_thread: dict[int, int] = {}
    for e in ops:
        if e.name.startswith(("ProfilerStep", "## ")):
            continue
        if e.time_range.start >= end_by_thread.get(e.thread, -1):
            out.append(e)
            end_by_thread[e.thread] = e.time_range.end
    return out


def is_lm_head(event, vocab: int | None) -> bool:
    """The LM head: the linear op whose weight has the vocabulary as its output size (from the
    recorded input shapes)."""
    shapes = list(event.input_shapes or [])
    if vocab is None or len(shapes) < 2 or not shapes[1]:
        return False
    w = shapes[1]
    # F.linear (out, in); pair / quad tiles (out/16, in/e, 16, e); channel tiles (out/16, in, ...)
    out = {2: w[0], 3: w[0] * 16, 4: w[0] * w[2]}.get(len(w))
    return out == vocab
