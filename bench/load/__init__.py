"""The pieces of the load test with faults (`python -m bench.load_test`, bench/load_test.py): one concern
a module. bench/load_faults.py holds the stand-ins for incidents, bench/locustfile.py the users."""
