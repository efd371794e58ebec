"""The pieces of the load test with faults (`python -m bench.load_test`, bench/load_test.py): one concern
a module; incidents.py holds the stand-ins for production incidents, bench/locustfile.py the users."""
