"""Verdicts, and nothing else: test outcomes read from JUnit, cell verdicts, throughput verdicts, the headline."""
