//! A TCP proxy in front of a Redis server that a test can pause: while paused, nothing is
//! read from or written to either side, so one store's connections stall as a network
//! partition would stall them while the server and every other store go on.

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A proxy on a free loopback port to `127.0.0.1:<target>`; stops when dropped.
pub struct Proxy {
    port: u16,
    paused: Arc<watch::Sender<bool>>,
    trigger: Trigger,
    accept: tokio::task::JoinHandle<()>,
}

/// Bytes that, once a client sends a chunk holding them, pause the proxy before it passes
/// that chunk on.
type Trigger = Arc<Mutex<Option<Vec<u8>>>>;

impl Proxy {
    pub async fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let paused = Arc::new(watch::channel(false).0);
        let gate = Arc::clone(&paused);
        let trigger: Trigger = Arc::default();
        let armed = Arc::clone(&trigger);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let upstream = Some((Arc::clone(&gate), Arc::clone(&armed)));
                tokio::spawn(pipe(client_read, server_write, gate.subscribe(), upstream));
                tokio::spawn(pipe(server_read, client_write, gate.subscribe(), None));
            }
        });
        Proxy {
            port,
            paused,
            trigger,
            accept,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    /// Pauses the proxy when a client next sends a chunk holding `bytes`, before that chunk
    /// reaches the server: a stall that hits one command and not the ones before it.
    pub fn pause_at(&self, bytes: &[u8]) {
        *self.trigger.lock().unwrap() = Some(bytes.to_vec());
    }

    pub fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    pub fn resume(&self) {
        self.paused.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies `from` to `to`, holding each chunk (and reading no more) while paused; from a
/// client (`upstream`: the pause switch and the trigger), a chunk that holds the trigger's
/// bytes pauses the proxy first.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut paused: watch::Receiver<bool>,
    upstream: Option<(Arc<watch::Sender<bool>>, Trigger)>,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        if paused.wait_for(|paused| !paused).await.is_err() {
            return;
        }
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some((gate, trigger)) = &upstream {
            let mut armed = trigger.lock().unwrap();
            let hit = armed
                .as_ref()
                .is_some_and(|bytes| buffer[..n].windows(bytes.len()).any(|w| w == bytes));
            if hit {
                *armed = None;
                gate.send_replace(true);
            }
        }
        if paused.wait_for(|paused| !paused).await.is_err() {
            return;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
