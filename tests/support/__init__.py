"""What the tests share: small models, launch helpers, fault injectors, and the worker scripts
that tests start in processes of their own (they import this package; the launch helpers put
the tests folder on a worker's path)."""
