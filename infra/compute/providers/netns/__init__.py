"""The netns provider in one package: the provider (provider), its emulated hosts, links and shaping
(emulation: network namespaces, veths, a bridge, tc), its store behind a shaped link (store: rclone serve s3) and
the job's `cluster.netns:` section (config).

May import: the local provider it builds on, access, the launcher record and the shared infra modules.
"""
