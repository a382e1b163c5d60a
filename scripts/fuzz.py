"""A longer schemathesis run than the suite's (tests/server/test_fuzz.py), same server and checks.

    python scripts/fuzz.py --max-examples 300 [--seed 7]

Starts the test server on 127.0.0.1 (the `llama-gqa` test model, runtime LoRA updates on),
runs `st run` against /openapi.json, then checks /health and the KV leak check. Exit
status 0 when schemathesis found nothing and the server is healthy.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_fuzz import FUZZ_SERVE_ARGS, schemathesis_command  # noqa: E402

from pagedserve.demo_models import get_model_path  # noqa: E402

from lora_utils import make_peft_adapter  # noqa: E402
from server_fixtures import TEST_MODEL, running_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-examples", type=int, default=300, help="test cases per operation and phase")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "adapters"
        root.mkdir()
        adapter = make_peft_adapter(str(get_model_path(TEST_MODEL)), None, 8, ["q_proj", "v_proj"], seed=1)
        shutil.copytree(adapter, root / "sql")
        with running_server([*FUZZ_SERVE_ARGS, "--lora-dir", str(root)]) as server:
            status = subprocess.run(schemathesis_command(server.base_url, args.max_examples, args.seed, args.workers),
                                    cwd=tmp).returncode
            health = httpx.get(server.base_url + "/health").status_code
            server.wait_idle()
            server.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())
    print(f"schemathesis exit status {status}; /health {health}; no KV leak")
    return 0 if status == 0 and health == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
