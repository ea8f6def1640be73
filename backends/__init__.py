"""Built-in device-backend plugins, installed as ``mcore.backends.*`` and registered through the
``mcore.backends`` entry-point group exactly as third-party plugins are.

``python -m mcore.backends`` (or ``mcore-info``) prints what is installed and which implementation
serves each op.
"""
