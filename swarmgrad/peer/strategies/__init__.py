"""Training strategies, one module each: its settings (a section of ``RunConfig``) and its policy
(what it contributes to a round and how it applies the average). base.py says what a strategy is;
registry.py finds them all."""
