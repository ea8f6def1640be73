"""``python -m mcore.backends``: installed backends, availability, capabilities and op providers."""

from __future__ import annotations

import argparse
import sys

from mcore.plugins.hookspecs import PLUGIN_API_VERSION
from mcore.plugins.manager import (
    BACKEND_METHODS,
    PluginError,
    installed_backends,
    plugin_manager,
    resolve_ops,
)


def report(out=sys.stdout) -> int:
    try:
        pm = plugin_manager()
        backends = installed_backends(pm)
    except PluginError as err:
        print(f"error: {err}", file=out)
        return 1
    print(
        f"mcore plugin API {PLUGIN_API_VERSION}; plugins: "
        + ", ".join(n for n, _ in pm.list_name_plugin() if n != BACKEND_METHODS),
        file=out,
    )
    for name, backend in sorted(backends.items(), key=lambda kv: -kv[1].priority):
        ok, why = backend.is_available()
        print(f"\nbackend {name} ({'available' if ok else 'unavailable'}: {why})", file=out)
        print(
            f"  device type {backend.device_type}, torch.distributed backend {backend.dist_backend}, "
            f"priority {backend.priority}",
            file=out,
        )
        if not ok:
            continue
        print(f"  capabilities: {', '.join(sorted(backend.capabilities())) or '-'}", file=out)
        resolve_ops(backend, pm)
        for op_name, entry in backend.ops:
            print(f"  op {op_name:<22} {entry.describe()}", file=out)
    return 0


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python -m mcore.backends", description=__doc__).parse_args(argv)
    return report()


if __name__ == "__main__":
    sys.exit(main())
