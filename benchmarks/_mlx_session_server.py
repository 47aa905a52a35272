"""mlx_lm.server itself (mlx_lm.server.main, unchanged), plus one read-only GET route for the session
benchmark: /ggfit/memory answers mlx's allocator counters, the prompt cache's size and the process's
VmRSS / VmHWM; /ggfit/reset-peak calls mx.reset_peak_memory() (after the load, before the session).

    python3 benchmarks/_mlx_session_server.py --model DIR [mlx_lm.server flags]
"""

from __future__ import annotations

import json
import sys


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    import mlx.core as mx
    from mlx_lm import server

    orig = server.APIHandler.do_GET

    def do_get(self) -> None:
        if self.path not in ("/ggfit/memory", "/ggfit/reset-peak"):
            return orig(self)
        if self.path == "/ggfit/reset-peak":
            mx.reset_peak_memory()
        pc = self.response_generator.prompt_cache
        body = json.dumps({
            "active": mx.get_active_memory(), "peak": mx.get_peak_memory(), "cache": mx.get_cache_memory(),
            "prompt_cache_entries": len(pc), "prompt_cache_nbytes": pc.nbytes,
            "vm_rss": _proc_kib("VmRSS"), "vm_hwm": _proc_kib("VmHWM"),
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    server.APIHandler.do_GET = do_get
    sys.argv = ["mlx_lm.server", *sys.argv[1:]]
    server.main()


if __name__ == "__main__":
    main()
