import os
import sys

# `python -m graphrt` puts the working directory first on sys.path. In a graphrt checkout
# that exposes the top-level kernels/ directory as a module named "kernels", hiding the
# PyPI package of that name (transformers >= 5.25 imports it when installed); graphrt's
# own modules are found through the package, so drop that entry there.
if sys.path and os.path.isfile(os.path.join(sys.path[0] or ".", "kernels", "paged_attention.py")):
    del sys.path[0]

from graphrt.cli import main  # noqa: E402

sys.exit(main())
