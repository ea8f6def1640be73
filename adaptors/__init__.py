"""MindSpeed-style adaptors, installed as ``mcore.adaptors.*`` (``import mcore.adaptors.npu``)."""
