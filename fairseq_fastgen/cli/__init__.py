"""The plugin's own command line loops (reached through the fairseq-* commands, see integration.py)."""
