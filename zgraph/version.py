"""The zgraph release this source tree is (``zgraph.__version__``)."""

__version__ = "0.1.0"
