"""Build the optional native copy loop; kvflow works without it (pure-Python fallback)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvflow._native",
            sources=["kvflow/_native.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
