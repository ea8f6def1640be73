"""Package layout: the vendor-free core in ``mcore/``, hardware in ``backends/`` and ``adaptors/``.

The top-level folders show the architecture; setuptools' ``package-dir`` installs them as
``mcore.backends.*`` and ``mcore.adaptors.*`` (editable installs resolve the mapping too).
"""

from setuptools import find_packages, setup

ROOTS = {"mcore": "mcore", "mcore.backends": "backends", "mcore.adaptors": "adaptors"}

packages, package_dir = [], {}
for package, folder in ROOTS.items():
    package_dir[package] = folder
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir, include_package_data=False)
