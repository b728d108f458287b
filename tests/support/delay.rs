//! A TCP proxy in front of a server that delays what it forwards by a one-way delay of its
//! own in each direction, as a network far away would: a request reaches the server `up`
//! after it was sent, its reply the client `down` after the server sent it.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A delaying proxy on a free loopback port to `127.0.0.1:<target>`; stops when dropped.
pub struct Delay {
    port: u16,
    accept: tokio::task::JoinHandle<()>,
}

impl Delay {
    /// Forwards to `target`, each chunk `up` later towards it and `down` later back.
    pub async fn start(target: u16, up: Duration, down: Duration) -> Delay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                client.set_nodelay(true).ok();
                server.set_nodelay(true).ok();
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pipe(client_read, server_write, up));
                tokio::spawn(pipe(server_read, client_write, down));
            }
        });
        Delay { port, accept }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Delay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read (in order).
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (send, mut chunks) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((due, chunk)) = chunks.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let mut buffer = vec![0; 64 * 1024];
    while let Ok(n @ 1..) = from.read(&mut buffer).await {
        if send
            .send((Instant::now() + delay, buffer[..n].to_vec()))
            .is_err()
        {
            break;
        }
    }
    drop(send);
    writer.await.ok();
}
