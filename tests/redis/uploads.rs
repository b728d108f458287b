//! Uploads metered as they stream, on instances that share Redis: the handlers of all of
//! them get at most the quota.
