//! The rule table replaced at run time: by `RuleTable::replace`, and from a TOML file that
//! `RuleTable::watch_file` follows. The next requests follow a new table; a policy that keeps
//! its name, algorithm and windows keeps its state; an invalid table or file is refused with
//! the line and the problem, and the rules in force stay.

use std::time::{Duration, Instant, UNIX_EPOCH};

use crate::support::http::{admitted, api_key, served};
use crate::support::Captured;
use tower_redis_ratelimit::config::ConfigError;
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::test_util::{box_and_slots, identity};
use tower_redis_ratelimit::{BuildError, MemoryStore, Policy, RateLimitLayer, Rule, Rules};

fn hourly(name: &str, count: u64) -> Policy {
    Policy::new(name, [format!("{count}/1h").parse().unwrap()]).unwrap()
}

fn store() -> MemoryStore {
    let clock = ManualClock::from(UNIX_EPOCH + Duration::from_secs(1_700_000_040));
    MemoryStore::builder().clock(clock).build()
}

#[tokio::test]
async fn a_replaced_table_decides_the_next_requests_and_keeps_state_by_name() {
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store())
        .policy(hourly("api", 5))
        .build()
        .unwrap();
    let table = layer.rule_table();
    let service = served(layer.clone());
    assert_eq!(admitted(&service, "c", 6).await, 5);

    // Same name and window, another count: the five used still count.
    table
        .replace(Rules::new().policy(hourly("api", 8)))
        .unwrap();
    assert_eq!(admitted(&service, "c", 4).await, 3);
    assert_eq!(default_policy(&layer).limits()[0].count(), 8);

    // An invalid table is refused as a whole; the one in force stays.
    let broken = Rules::new()
        .rule(Rule::new(hourly("login", 1)).path("no-slash"))
        .policy(hourly("api", 100));
    assert!(matches!(
        table.replace(broken),
        Err(BuildError::Pattern { .. })
    ));
    assert_eq!(admitted(&service, "c", 1).await, 0);
    assert!(matches!(
        table.replace(Rules::new()),
        Err(BuildError::NoPolicy)
    ));

    // A rule added at run time takes its requests; the others keep the default.
    table
        .replace(
            Rules::new()
                .rule(Rule::new(hourly("vip", 2)).when(|head| head.headers.contains_key("x-vip")))
                .policy(hourly("api", 8)),
        )
        .unwrap();
    let vip = || {
        let mut request = crate::support::http::keyed("c");
        request.headers_mut().insert("x-vip", "1".parse().unwrap());
        request
    };
    let mut vip_admitted = 0;
    for _ in 0..3 {
        use tower::ServiceExt;
        let response = service.clone().oneshot(vip()).await.unwrap();
        vip_admitted += usize::from(response.status() == 200);
    }
    assert_eq!(vip_admitted, 2, "the new rule's own budget");
    assert_eq!(admitted(&service, "c", 1).await, 0, "the default's state");
}

/// The documented example file parses, and gives what it says.
#[test]
fn the_example_file_is_valid() {
    let rules = Rules::from_toml(include_str!("../../../examples/rules.toml")).unwrap();
    let layer = RateLimitLayer::builder()
        .plan(|head| head.headers.get("x-plan").and_then(|v| v.to_str().ok()))
        .rules(rules)
        .build()
        .unwrap();
    let names: Vec<String> = layer
        .rule_table()
        .policies()
        .iter()
        .map(|p| identity(p).to_owned())
        .collect();
    assert_eq!(
        names,
        [
            "login:log:1m+1h",
            "export:log:1h",
            "api:gcra:1m+1d",
            "default:log:300/1m"
        ]
    );
    let policies = layer.rule_table().policies();
    let export = policies.iter().find(|p| p.name() == "export").unwrap();
    let (_, slots, lifetime) = box_and_slots(export);
    assert_eq!((slots, lifetime), (Some(2), Duration::from_secs(30)));
}

/// `soft` and `block_for` in a file, on a rule and on the default policy.
#[tokio::test]
async fn a_file_sets_soft_limits_and_penalty_boxes() {
    let send = |layer: &RateLimitLayer<tower_redis_ratelimit::Header, MemoryStore>,
                path: &'static str| {
        let service = served(layer.clone());
        async move {
            use tower::ServiceExt;
            let mut request = crate::support::http::keyed("c");
            *request.uri_mut() = path.parse().unwrap();
            let response = service.oneshot(request).await.unwrap();
            let retry = response.headers().get("retry-after").cloned();
            (
                response.status().as_u16(),
                retry.map(|r| r.to_str().unwrap().to_owned()),
            )
        }
    };
    let build = |text: &str| {
        RateLimitLayer::builder()
            .key(api_key())
            .store(store())
            .rules(Rules::from_toml(text).unwrap())
            .build()
            .unwrap()
    };
    let boxed = build(
        "[default]\nname = \"api\"\nlimits = \"1/1m\"\nblock_for = \"15m\"\n\n\
         [[rule]]\nname = \"login\"\nlimits = \"1/1h\"\npath = \"/login\"\nsoft = true\n",
    );
    assert_eq!(
        box_and_slots(&default_policy(&boxed)).0,
        Some(Duration::from_secs(900))
    );
    assert_eq!(send(&boxed, "/login").await.0, 200);
    assert_eq!(
        send(&boxed, "/login").await.0,
        200,
        "soft: passed on over the limit"
    );
    assert_eq!(send(&boxed, "/").await.0, 200);
    // The box (15 minutes) outlasts the limit (a minute): its `Retry-After`.
    assert_eq!(send(&boxed, "/").await, (429, Some("900".into())));

    let soft_default = build("[default]\nlimits = \"1/1h\"\nsoft = true\n");
    assert_eq!(send(&soft_default, "/").await.0, 200);
    let over = send(&soft_default, "/").await;
    assert_eq!(over.0, 200, "the default policy is soft too");
}

/// Files with one problem each, and the line and words the refusal must carry.
#[test]
fn a_broken_file_is_refused_with_its_line_and_problem() {
    let good = "[default]\nlimits = \"100/1m\"\n";
    assert!(Rules::from_toml(good).is_ok());
    let cases: [(&str, usize, &str); 17] = [
        ("[[rule]]\nlimits = \"5/1m\"\nmethod = \"PSOT\"\n", 3, "unknown method"),
        ("[[rule]]\nlimits = \"5/1m\"\nconcurrency = 0\n", 3, "concurrency limit of 0"),
        ("[[rule]]\nlimits = \"5/1m\"\nconcurrency = -2\n", 3, "u32"),
        ("[[rule]]\nlimits = \"5/1m\"\nslot_expiry = \"2h\"\n", 3, "slot expiry"),
        ("[[rule]]\nlimits = \"5/1m\"\nblock_for = \"0s\"\n", 3, "at least 1ms"),
        ("[[rule]]\nlimits = \"5/1m\"\n\nblock_for = \"15q\"\n", 4, "15q"),
        ("[[rule]]\nname = \"a\"\nlimits = \"5/100000d\"\n", 3, "3650 days"),
        ("[[rule]]\nname = \"a\"\nlimits = \"5/1fortnight\"\n", 3, "fortnight"),
        ("[[rule]]\nname = \"a\"\nlimits = \"-5/1m\"\n", 3, "-5"),
        ("[[rule]]\nname = \"a\"\nlimits = \"5/-1m\"\n", 3, "-1m"),
        ("[[rule]]\nname = \"a b\"\nlimits = \"5/1m\"\n", 2, "a b"),
        ("[[rule]]\nlimits = \"5/1m\"\npath = \"login\"\n", 3, "must start with /"),
        ("[[rule]]\nlimits = \"5/1m\"\nalgorithm = \"bucket\"\n", 3, "bucket"),
        ("[[rule]]\nlimits = \"5/1m\"\nlimit = \"6/1m\"\n", 3, "unknown field"),
        (
            "[[rule]]\nname = \"api\"\nlimits = \"60/1m\"\nplans = { pro = \"600/1h\" }\n",
            4,
            "1m",
        ),
        (
            "[[rule]]\nname = \"a\"\nlimits = \"5/1m\"\npath = \"/x\"\n\n[[rule]]\nname = \"a\"\nlimits = \"6/1m\"\n",
            6,
            "two different policies",
        ),
        ("[[rule]]\nname = \"a\"\nlimits = \"5/1m\n", 3, ""),
    ];
    for (text, line, words) in cases {
        match Rules::from_toml(text) {
            Err(ConfigError::Invalid { line: at, message }) => {
                assert_eq!(at, line, "{text:?}: {message}");
                assert!(message.contains(words), "{text:?}: {message}");
            }
            other => panic!("{text:?}: {other:?}"),
        }
    }
    assert!(matches!(
        Rules::from_toml("# nothing\n"),
        Err(ConfigError::Invalid { .. })
    ));
}

/// Waits up to five seconds for `condition`.
async fn eventually<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(5);
    while !condition().await {
        assert!(Instant::now() < deadline, "{what}: not within 5 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_watched_file_is_followed_and_a_broken_one_keeps_the_rules_in_force() {
    let captured = Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber());
    let dir = std::env::temp_dir().join(format!("rule-table-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rules.toml");
    let write = |limits: &str| {
        let text = format!("[default]\nname = \"api\"\nlimits = \"{limits}\"\n");
        std::fs::write(&file, text).unwrap();
    };
    write("2/1h");
    let rules = Rules::from_toml(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store())
        .rules(rules)
        .build()
        .unwrap();
    let watch = layer
        .rule_table()
        .watch_file(file.clone(), Duration::from_millis(20));
    let service = served(layer.clone());
    assert_eq!(admitted(&service, "c", 3).await, 2);

    write("4/1h");
    let count = || default_policy(&layer).limits()[0].count();
    eventually("the raise", || async { count() == 4 }).await;
    assert_eq!(admitted(&service, "c", 3).await, 2, "two more of 4/1h");
    assert!(captured.text().contains("rate-limit rules applied"));

    std::fs::write(
        &file,
        "[default]\nname = \"api\"\nlimits = \"9/1h\"\nextra = 1\n",
    )
    .unwrap();
    eventually("the refusal logged", || async {
        captured.text().contains("rules refused")
    })
    .await;
    let log = captured.text();
    assert!(
        log.contains("line 4") && log.contains("unknown field"),
        "{log}"
    );
    assert_eq!(count(), 4, "the rules in force stay");
    assert_eq!(admitted(&service, "c", 1).await, 0);

    write("5/1h");
    eventually("the fixed file", || async { count() == 5 }).await;
    assert_eq!(admitted(&service, "c", 2).await, 1);
    watch.abort();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rules file to be cut in two: login's and export's rules, then `[default]`, last.
const RULES: &str = r#"[[rule]]
name = "login"
limits = "2/1h"
path = "/login"

[[rule]]
name = "export"
limits = "1/1h"
path = "/export"

[default]
name = "api"
limits = "3/1h"
"#;

/// The first half of `RULES`: it parses, as a table without a default policy.
fn first_half() -> &'static str {
    &RULES[..RULES.find("[default]").unwrap()]
}

/// A layer built from `text`, whose table `watch_file` follows every second (tokio's clock),
/// the file in a directory of this test's own (removed when the guard drops), and the logs.
struct Watched {
    layer: RateLimitLayer<tower_redis_ratelimit::Header, MemoryStore>,
    file: std::path::PathBuf,
    captured: Captured,
    _log: tracing::subscriber::DefaultGuard,
    watch: tokio::task::JoinHandle<()>,
}

const EVERY: Duration = Duration::from_secs(1);

impl Watched {
    fn start(test: &str, text: &str) -> Watched {
        let captured = Captured::default();
        let log = tracing::subscriber::set_default(captured.subscriber());
        let dir = std::env::temp_dir().join(format!("{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("rules.toml");
        std::fs::write(&file, text).unwrap();
        let layer = RateLimitLayer::builder()
            .key(api_key())
            .store(store())
            .rules(Rules::from_toml(text).unwrap())
            .build()
            .unwrap();
        let watch = layer.rule_table().watch_file(file.clone(), EVERY);
        Watched {
            layer,
            file,
            captured,
            _log: log,
            watch,
        }
    }

    /// Of `tries` requests of `key` to `path`, how many pass.
    async fn admitted(&self, path: &str, key: &str, tries: usize) -> usize {
        use tower::ServiceExt;
        let service = served(self.layer.clone());
        let mut admitted = 0;
        for _ in 0..tries {
            let mut request = crate::support::http::keyed(key);
            *request.uri_mut() = path.parse().unwrap();
            let response = service.clone().oneshot(request).await.unwrap();
            admitted += usize::from(response.status() == 200);
        }
        admitted
    }

    /// How many times the rules were applied, by the logs.
    fn applied(&self) -> usize {
        self.captured
            .text()
            .matches("rate-limit rules applied")
            .count()
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.watch.abort();
        let _ = std::fs::remove_dir_all(self.file.parent().unwrap());
    }
}

/// The file is written in two halves, one watch interval apart, each just after a read (the
/// worst moment): the watcher reads the half once and never applies it, though it parses (a
/// table without a default policy: `/` would go unlimited). The whole file is applied once it
/// has stayed the same for an interval. On tokio's paused clock: the reads happen at whole
/// seconds, the writes between them.
#[tokio::test(start_paused = true)]
async fn a_rules_file_written_in_two_halves_is_applied_only_whole() {
    let before = RULES.replace("\"3/1h\"", "\"2/1h\"");
    let watched = Watched::start("two-halves", &before);
    tokio::time::sleep(EVERY * 3 / 2).await; // 1.5 s: reads at 0 s and 1 s, the same file
    assert_eq!(watched.applied(), 1, "the file in place, once it settled");

    std::fs::write(&watched.file, first_half()).unwrap();
    tokio::time::sleep(EVERY).await; // 2.5 s: the half was read at 2 s
    assert_eq!(
        watched.admitted("/", "c", 3).await,
        2,
        "the default of 2/1h stays"
    );
    std::fs::write(&watched.file, RULES).unwrap();
    tokio::time::sleep(EVERY).await; // 3.5 s: the whole file was read at 3 s, once
    assert_eq!(watched.applied(), 1, "{}", watched.captured.text());
    assert_eq!(watched.admitted("/", "c", 1).await, 0, "the old rules stay");

    tokio::time::sleep(EVERY).await; // 4.5 s: read again at 4 s, unchanged: applied
    assert_eq!(watched.applied(), 2, "{}", watched.captured.text());
    assert_eq!(watched.admitted("/", "c", 2).await, 1, "one more of 3/1h");
    assert_eq!(watched.admitted("/login", "c", 3).await, 2);
    let log = watched.captured.text();
    assert!(!log.contains("unlimited"), "{log}");
}

/// A complete file that drops the default policy and login's rule, then one that makes
/// export's rule soft: each is applied (it is what the operator wrote) and logged at WARN,
/// naming the requests no longer limited. A raise is not.
#[tokio::test(start_paused = true)]
async fn rules_that_leave_requests_unlimited_are_logged_at_warn() {
    let watched = Watched::start("unlimited", RULES);
    let settled = EVERY * 3 / 2;
    tokio::time::sleep(settled).await;
    let raised = RULES.replace("\"3/1h\"", "\"30/1h\"");
    std::fs::write(&watched.file, &raised).unwrap();
    tokio::time::sleep(settled + EVERY).await;
    assert_eq!(watched.applied(), 2);
    assert!(!watched.captured.text().contains("WARN"));

    let export = &raised[raised.find("[[rule]]\nname = \"export\"").unwrap()..];
    let export = &export[..export.find("[default]").unwrap()];
    std::fs::write(&watched.file, export).unwrap();
    tokio::time::sleep(settled + EVERY).await;
    assert_eq!(watched.admitted("/", "c", 5).await, 5, "no default policy");
    let log = watched.captured.text();
    let warned: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warned.len(), 1, "{log}");
    assert!(
        warned[0].contains("leave requests unlimited")
            && warned[0].contains(r#"GET /login of rule "login" (no rule or default policy now)"#)
            && warned[0].contains(r#"requests no rule matches (default policy "api" removed)"#),
        "{log}"
    );

    std::fs::write(&watched.file, format!("{export}soft = true\n")).unwrap();
    tokio::time::sleep(settled + EVERY).await;
    let log = watched.captured.text();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains(r#"GET /export of rule "export" (now soft policy "export")"#)),
        "{log}"
    );
}

/// A rules edit that leaves a route unlimited without removing its rule is named too: a soft
/// catch-all put first, a rule moved to another path, a rule given another method. Each is
/// decided as before by a request of each rule tried against the new table.
#[tokio::test(start_paused = true)]
async fn routes_left_unlimited_by_a_moved_or_shadowed_rule_are_logged_at_warn() {
    let login =
        "[[rule]]\nname = \"login\"\nlimits = \"2/1h\"\npath = \"/login\"\nmethod = \"POST\"\n";
    let edits = [
        (
            format!("[[rule]]\nname = \"all\"\nlimits = \"1/1h\"\npath = \"/**\"\nsoft = true\n\n{login}"),
            r#"POST /login of rule "login" (now soft policy "all")"#,
        ),
        (
            login.replace("path = \"/login\"", "path = \"/signin\""),
            r#"POST /login of rule "login" (no rule or default policy now)"#,
        ),
        (
            login.replace("POST", "GET"),
            r#"POST /login of rule "login" (no rule or default policy now)"#,
        ),
    ];
    for (i, (edited, named)) in edits.iter().enumerate() {
        let watched = Watched::start(&format!("moved-{i}"), login);
        let settled = EVERY * 3 / 2;
        tokio::time::sleep(settled).await;
        std::fs::write(&watched.file, edited).unwrap();
        tokio::time::sleep(settled + EVERY).await;
        let log = watched.captured.text();
        assert!(
            log.lines().any(|l| l.contains("WARN") && l.contains(named)),
            "edit {i}: {log}"
        );
    }
}

/// The layer's default policy: the last of the policies in force.
fn default_policy<K, St>(layer: &tower_redis_ratelimit::RateLimitLayer<K, St>) -> Policy {
    let policies = layer.rule_table().policies();
    policies.last().cloned().expect("a default policy")
}
