"""The Files API (issue 37): tenants' batch input files and the batches' output files."""
