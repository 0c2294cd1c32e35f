"""Prints ``<include dir>;<jaxlib version>`` of the XLA FFI headers to build against (CMake).

The jaxlib installed in the environment the package is being installed into comes first: pip's
isolated build runs that environment's own interpreter, so sysconfig (and the user site) still
name its site-packages even though they are off ``sys.path``. Without one there, the jaxlib of
the build environment (``build-system.requires``) is used. Exit code 1 when neither has them.
"""

from __future__ import annotations

import os
import re
import site
import sysconfig


def _version(jaxlib_dir: str) -> str:
    text = open(os.path.join(jaxlib_dir, "version.py")).read()
    m = re.search(r"^_version\s*(?::\s*str)?\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return m.group(1) if m else "unknown"


def main() -> int:
    places = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    if site.ENABLE_USER_SITE:
        places.append(site.getusersitepackages())
    try:
        import jaxlib  # the build environment's

        places.append(os.path.dirname(os.path.dirname(jaxlib.__file__)))
    except ImportError:
        pass
    for place in places:
        jaxlib_dir = os.path.join(place, "jaxlib")
        include = os.path.join(jaxlib_dir, "include")
        if os.path.isfile(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
            print(f"{include};{_version(jaxlib_dir)}", end="")
            return 0
    print("looked in " + ", ".join(places), end="")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
