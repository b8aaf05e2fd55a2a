//! A stand-in model server for the scrape tests: answers each GET, on a connection of its own
//! (`connection: close`), as the test's function says, and keeps the request targets in order.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A running stand-in.
pub(crate) struct TestPod {
    /// Where it listens.
    pub(crate) addr: SocketAddr,
    asked: Arc<Mutex<Vec<String>>>,
}

impl TestPod {
    /// The request targets (path and query) it was asked for so far.
    pub(crate) fn asked(&self) -> Vec<String> {
        self.asked.lock().expect("log").clone()
    }
}

/// The real vLLM 0.32 metrics page (`metrics-load.txt`).
pub(crate) fn vllm_page() -> Vec<u8> {
    std::fs::read(crate::test_paths::fixtures().join("vllm-0.32-kv-events/metrics-load.txt"))
        .expect("fixture")
}

/// Serves `answer(target)` (a status line's status, and a body) to every GET.
pub(crate) async fn serve(
    answer: impl Fn(&str) -> (&'static str, Vec<u8>) + Send + Sync + 'static,
) -> TestPod {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let asked = Arc::new(Mutex::new(Vec::new()));
    let (log, answer) = (Arc::clone(&asked), Arc::new(answer));
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let (log, answer) = (Arc::clone(&log), Arc::clone(&answer));
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&request);
                let target = text.split(' ').nth(1).unwrap_or_default().to_owned();
                let (status, body) = answer(&target);
                log.lock().expect("log").push(target);
                let head = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(&body).await;
            });
        }
    });
    TestPod { addr, asked }
}
