import sys

# From a graphrt checkout's root, the top-level kernels/ directory is on sys.path as a module
# named "kernels"; it hands that import to the PyPI package of the name (kernels/__init__.py).
from graphrt.cli import main

sys.exit(main())
