"""The `tinkerq` command (cli.py) and what its subcommands run: the demos and an embedded Redis. The roof of the
project: it imports worker/, producer/ and the shared floor in tinkerq/, and nothing imports it but tests."""
