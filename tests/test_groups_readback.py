"""Byte-level read-back with KV cache groups: every live sequence reads back, per group,
exactly the history its next step reads (kvblocks.testing.KVReadback, GroupsEngineMachine)."""

from kvblocks.testing.machines import GroupsEngineMachine

TestGroupsEngine = GroupsEngineMachine.TestCase
