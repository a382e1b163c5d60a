"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the rejection
sampler that verifies their guesses exactly, and the per-request policy that decides who
speculates (see docs/structure.md)."""
