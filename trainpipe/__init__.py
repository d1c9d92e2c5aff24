"""The `trainpipe` command line: thin commands over infra, flows and the Prefect server. The top of the tree with flows;
nothing under infra/ or trainer/ imports it."""
