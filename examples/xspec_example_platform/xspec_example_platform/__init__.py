"""An out-of-tree xspec platform, registered through the ``xspec.platforms`` entry point."""

from xspec_example_platform.platform import ExampleCpuPlatform

__all__ = ["ExampleCpuPlatform"]
