//! Request bodies metered as they stream: concurrent uploads of one key never pass the quota
//! at the handlers, the unused part of the last step is refunded, and a refused step is
//! answered 413 or 429 as HTTP says.
