"""What a hospital's trust rests on: its policy, privacy ledger and audit log, its identity, the code and argument
gates, and the secure-aggregation protocol."""
