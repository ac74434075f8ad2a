# Vendored from https://github.com/OpenRLHF/OpenRLHF, commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7,
# file openrlhf/__init__.py (git blob e69de29bb2d1d6434b8b29ae775ad8c2e48c5391): everything below this header is that file, unchanged.
# ---
