"""The models a deployment serves: its base models (catalog), their prompts and tokenizers, and the
tenants' adapters resolved by name."""
