"""The version suite: real pytest sessions of a small project on the installed torch (tox -e torch27 ... torch215)."""
