"""Build the Cython hot path in native/ into stealer._cqueues.

The .pyx is cythonized under its own name (so its .pxd beside it in native/
is found), then compiled as the extension stealer._cqueues (PyInit__cqueues
matches the last component).  Set STEALER_NO_EXTENSIONS=1 at build time to
skip compiling: the package then runs on its pure-Python reference queues
and says so once.
"""

import os

from setuptools import Extension, setup

ext_modules = []
if os.environ.get("STEALER_NO_EXTENSIONS") != "1":
    from Cython.Build import cythonize

    (generated,) = cythonize(
        ["native/_cqueues.pyx"],
        include_path=["native"],
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    )
    ext_modules = [
        Extension(
            "stealer._cqueues",
            generated.sources,
            include_dirs=["native"],
            extra_compile_args=["-O2", "-std=gnu11"],
        )
    ]

setup(ext_modules=ext_modules)
