//! Following a rules file (feature `config`): [`RuleTable::watch_file`] puts a new content in
//! force once it is complete, and says what it did, and when a change leaves requests without
//! a limit.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::config::ConfigError;
use super::table::Table;
use super::{RuleTable, Rules};
use crate::Policy;

/// What one read of the file gave: its text, or why it could not be read.
type Read = Result<String, String>;

impl RuleTable {
    /// Reads the rules file at `path` every `every` and, when its content has changed and
    /// stayed the same for one interval, puts its rules in force. Each change is logged
    /// (`tracing`, target `tower_redis_ratelimit`): INFO with the policies applied, or WARN
    /// with the line and the problem when the file is refused and the rules in force stay. A
    /// change that leaves requests unlimited where the rules in force limited them (a rule
    /// removed with no default policy to take its requests, the default policy removed, or
    /// either made soft) is logged at WARN too, naming them. Runs until the returned task is
    /// aborted. Call it within a Tokio runtime. Feature `config`.
    ///
    /// **A file is applied only when complete.** A file read while it is being written may
    /// hold only its beginning, and a beginning often parses: cut before a `[default]` table,
    /// it is a table without a default policy, so every request that no rule matches would go
    /// unlimited. So a new content is applied only once two reads one interval apart find it
    /// the same (the first read, when the watcher starts, waits for the next one too). Any
    /// writer that finishes within one interval is safe, with no end marker, checksum or
    /// file-system notification to set up; those would ask every writer to add the marker, or
    /// miss editors that write in place. A writer that stalls for longer than an interval
    /// halfway can still have its beginning applied, so write the file whole elsewhere and
    /// move it into place: a rename within one file system is atomic, and a read finds the
    /// old file or the new one, never part of either.
    ///
    /// ```sh
    /// cat > /etc/myapp/rules.toml.tmp <<'EOF'
    /// [default]
    /// limits = "300/1m"
    /// EOF
    /// mv /etc/myapp/rules.toml.tmp /etc/myapp/rules.toml
    /// ```
    ///
    /// (The temporary file must be on the same file system: beside the file, not in `/tmp`.)
    /// The content is compared rather than the modification time, so that an edit within the
    /// time's resolution is not missed; a file replaced by a rename is followed too.
    pub fn watch_file(
        &self,
        path: impl Into<PathBuf>,
        every: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let (table, path) = (self.clone(), path.into());
        tokio::spawn(async move {
            let mut watch = Settling::default();
            loop {
                let read = std::fs::read_to_string(&path).map_err(|error| error.to_string());
                if let Some(read) = watch.settle(read) {
                    table.apply(&path, &read);
                }
                tokio::time::sleep(every).await;
            }
        })
    }

    /// Applies what [`watch_file`](Self::watch_file) read, and logs it.
    fn apply(&self, path: &Path, read: &Read) {
        let file = path.display();
        let outcome = match read {
            Ok(text) => Rules::from_toml(text).and_then(|rules| self.replace_warning(path, rules)),
            Err(error) => {
                let error = std::io::Error::other(error.clone());
                let path = path.to_owned();
                Err(ConfigError::Read { path, error })
            }
        };
        match outcome {
            Ok(()) => {
                let policies: Vec<String> = self.policies().iter().map(describe).collect();
                tracing::info!(
                    target: "tower_redis_ratelimit",
                    %file,
                    policies = %policies.join(", "),
                    "rate-limit rules applied"
                );
            }
            Err(error) => tracing::warn!(
                target: "tower_redis_ratelimit",
                %file,
                error = %crate::chain::Chain(&error),
                "rate-limit rules refused; the rules in force stay"
            ),
        }
    }

    /// Puts `rules`, read from `path`, in force, and warns of the requests they leave
    /// unlimited where the rules before limited them.
    pub(super) fn replace_warning(&self, path: &Path, rules: Rules) -> Result<(), ConfigError> {
        let before = self.load();
        let before = Arc::clone(&*before);
        self.replace(rules)?;
        let lost = unlimited(&before, &self.load());
        if !lost.is_empty() {
            tracing::warn!(
                target: "tower_redis_ratelimit",
                file = %path.display(),
                unlimited = %lost.join(", "),
                "rate-limit rules applied leave requests unlimited that were limited"
            );
        }
        Ok(())
    }
}

/// The reads of a watched file, and which of them to apply: a content read twice in a row,
/// one interval apart, that is not the one applied last.
#[derive(Default)]
struct Settling {
    /// The previous read.
    seen: Option<Read>,
    /// The read applied last.
    applied: Option<Read>,
}

impl Settling {
    /// What to apply after reading `read`, if anything.
    fn settle(&mut self, read: Read) -> Option<Read> {
        let stable = self.seen.as_ref() == Some(&read);
        self.seen = Some(read);
        if !stable || self.applied == self.seen {
            return None;
        }
        self.applied.clone_from(&self.seen);
        self.applied.clone()
    }
}

/// The requests that `before` limited and `after` does not. Each rule of `before` is tried
/// with a request it matches (its method, GET where it names none, and its path with `x`
/// for each wildcard segment), as both tables decide it: a rule removed, made soft, moved to
/// another path or method, or shadowed by a soft rule put before it, is named with that
/// request. A rule with a predicate cannot be tried so and is left out (a rules file has
/// none). The default policy is named where it was removed or made soft.
fn unlimited(before: &Table, after: &Table) -> Vec<String> {
    let mut lost = Vec::new();
    for (name, method, path) in before.probes() {
        // A rule that an earlier one shadows, or that is soft, limited nothing of its own.
        if before.decides(&method, &path) != Some((name.clone(), true)) {
            continue;
        }
        match after.decides(&method, &path) {
            Some((_, true)) => {}
            Some((other, false)) => lost.push(format!(
                "{method} {path} of rule {name:?} (now soft policy {other:?})"
            )),
            None => lost.push(format!(
                "{method} {path} of rule {name:?} (no rule or default policy now)"
            )),
        }
    }
    if let Some((name, true)) = &before.default_limits() {
        match &after.default_limits() {
            Some((_, true)) => {}
            Some((_, false)) => lost.push(format!("default policy {name:?} (now soft)")),
            None => lost.push(format!(
                "requests no rule matches (default policy {name:?} removed)"
            )),
        }
    }
    lost
}

/// `login 5/1m + 20/1h`.
fn describe(policy: &Policy) -> String {
    let limits: Vec<String> = policy.limits().iter().map(|l| l.to_string()).collect();
    format!("{} {}", policy.name(), limits.join(" + "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_content_is_applied_once_read_twice_in_a_row() {
        let mut watch = Settling::default();
        let read = |text: &str| Ok(text.to_owned());
        assert_eq!(watch.settle(read("a")), None, "the first read waits");
        assert_eq!(watch.settle(read("a")), Some(read("a")));
        assert_eq!(watch.settle(read("a")), None, "applied already");
        assert_eq!(watch.settle(read("a, b")), None, "a half, once");
        assert_eq!(watch.settle(read("a, b, c")), None);
        assert_eq!(watch.settle(read("a, b, c")), Some(read("a, b, c")));
        assert_eq!(watch.settle(Err("gone".into())), None);
        assert_eq!(
            watch.settle(read("a, b, c")),
            None,
            "back before it settled"
        );
        assert_eq!(watch.settle(Err("gone".into())), None);
        assert_eq!(watch.settle(Err("gone".into())), Some(Err("gone".into())));
    }
}
