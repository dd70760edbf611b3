"""Model files and engine installs onto the machine, with progress."""
