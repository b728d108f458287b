//! Response streams metered as they go: cut within one step of the quota, visible in the
//! store while they run, and a client that leaves charged what was sent.
