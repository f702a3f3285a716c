"""Frontend launchers of the benchmark (see launch.py and README.md)."""
