"""torch.compile over the decode forward (issue 18): opt-in with `compilation_config`."""
