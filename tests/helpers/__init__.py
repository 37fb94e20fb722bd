"""Helpers of the test suite: reference computations, rank processes, launchers, synthetic data."""
