"""Who owns which shard, and the writes that ownership guards: fenced leases (`fencing`), riding out a Redis
outage (`outage`), the even split of shards among balanced workers (`membership`), a standby's warming of the bases
it may have to serve (`preload`)."""
