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
    /// Each connection's own pause switch.
    connections: Arc<Mutex<Vec<Arc<watch::Sender<bool>>>>>,
    accept: tokio::task::JoinHandle<()>,
}

/// Bytes that, once a client sends a chunk holding them, pause the proxy before it passes
/// that chunk on, or only that chunk's connection (`true`).
type Trigger = Arc<Mutex<Option<(Vec<u8>, bool)>>>;

/// A connection's pause switches, the proxy's and its own, and for the client's side the
/// trigger.
struct Gates {
    proxy: Arc<watch::Sender<bool>>,
    own: Arc<watch::Sender<bool>>,
    trigger: Option<Trigger>,
}

impl Proxy {
    pub async fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let paused = Arc::new(watch::channel(false).0);
        let gate = Arc::clone(&paused);
        let trigger: Trigger = Arc::default();
        let armed = Arc::clone(&trigger);
        let connections: Arc<Mutex<Vec<Arc<watch::Sender<bool>>>>> = Arc::default();
        let all = Arc::clone(&connections);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let own = Arc::new(watch::channel(false).0);
                all.lock().unwrap().push(Arc::clone(&own));
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let gates = |trigger| Gates {
                    proxy: Arc::clone(&gate),
                    own: Arc::clone(&own),
                    trigger,
                };
                tokio::spawn(pipe(
                    client_read,
                    server_write,
                    gates(Some(Arc::clone(&armed))),
                ));
                tokio::spawn(pipe(server_read, client_write, gates(None)));
            }
        });
        Proxy {
            port,
            paused,
            trigger,
            connections,
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
        *self.trigger.lock().unwrap() = Some((bytes.to_vec(), false));
    }

    /// Pauses only the connection that next sends a chunk holding `bytes`, before that chunk
    /// reaches the server: one stalled connection of a pool, the others going on.
    pub fn pause_connection_at(&self, bytes: &[u8]) {
        *self.trigger.lock().unwrap() = Some((bytes.to_vec(), true));
    }

    pub fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    pub fn resume(&self) {
        self.paused.send_replace(false);
        for connection in self.connections.lock().unwrap().iter() {
            connection.send_replace(false);
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies `from` to `to`, holding each chunk (and reading no more) while the proxy or the
/// connection is paused; from a client (`gates.trigger`), a chunk that holds the trigger's
/// bytes pauses the proxy, or the connection, first.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    gates: Gates,
) {
    let (mut proxy, mut own) = (gates.proxy.subscribe(), gates.own.subscribe());
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        if !open(&mut proxy, &mut own).await {
            return;
        }
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some(trigger) = &gates.trigger {
            let mut armed = trigger.lock().unwrap();
            let hit = armed.as_ref().and_then(|(bytes, alone)| {
                let found = buffer[..n].windows(bytes.len()).any(|w| w == bytes);
                found.then_some(*alone)
            });
            if let Some(alone) = hit {
                *armed = None;
                match alone {
                    true => gates.own.send_replace(true),
                    false => gates.proxy.send_replace(true),
                };
            }
        }
        if !open(&mut proxy, &mut own).await {
            return;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

/// Waits until neither switch is on; false when the proxy is gone.
async fn open(proxy: &mut watch::Receiver<bool>, own: &mut watch::Receiver<bool>) -> bool {
    loop {
        if proxy.wait_for(|paused| !paused).await.is_err() {
            return false;
        }
        if own.wait_for(|paused| !paused).await.is_err() {
            return false;
        }
        if !*proxy.borrow() {
            return true;
        }
    }
}
