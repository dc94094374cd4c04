//! Serving an axum router over HTTP/1.1 with bounds on what one client can
//! hold (feature `http`).
//!
//! `axum::serve` sets no timer on hyper, so hyper's header read timeout is
//! off: a client that sends a request's head a byte a second, or opens a
//! connection and sends nothing, holds it (and its file descriptor and task)
//! for as long as it likes, and nothing bounds how many it opens. [`serve`]
//! is the same accept loop with the bounds on:
//!
//! * a header read timeout: a request's head (request line and headers)
//!   must arrive within it, counted from the moment the server waits for it,
//!   which is from accept for a connection's first request and from the
//!   previous response on a keep-alive connection: it is the idle bound too.
//!   Past it, hyper closes the connection;
//! * a cap on the connections open at once. At the cap the loop accepts no
//!   more until one closes: new clients wait in the kernel's accept backlog
//!   (the listener's, 1,024 for a tokio listener; past it the kernel drops
//!   their SYNs and they retry). Waiting rather than accepting and closing
//!   keeps a burst of valid clients served in turn as slots free up (a slow
//!   client's slot frees within the header read timeout) instead of turning
//!   it into errors.
//!
//! A request's body and its handling are the router's to bound (a timeout
//! layer answering in its own error format): the body is read inside the
//! handler. A response written while the body is still unread closes the
//! connection (hyper does not drain a slow body).
//!
//! HTTP/1.1 only: the pipeline's HTTP clients speak it (HTTP/2 is the gRPC
//! API's), and HTTP/2's cleartext prior-knowledge handshake has no read
//! timeout in hyper.

use std::io;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio_util::sync::CancellationToken;

/// What one HTTP server lets its clients hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// How long a client may take to send a request's head, from accept or
    /// from the previous response (so also how long a keep-alive
    /// connection may sit idle). Past it the connection is closed.
    pub header_read_timeout: Duration,
    /// Connections open at once; at the cap new ones wait in the kernel's
    /// accept backlog until one closes.
    pub max_connections: usize,
}

impl Default for Limits {
    /// 10 s for a request's head (a valid client sends it at once; hyper's
    /// own default, when a timer is set, is 30 s) and 1,024 connections (a
    /// metrics endpoint or a webhook receiver has a handful of clients).
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            max_connections: 1024,
        }
    }
}

/// Serves `router` on `listener` within `limits` until `cancel` fires; then
/// accepts no more, closes idle connections, and returns when the requests
/// in flight have been answered (bound that wait from outside).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    cancel: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Every connection's task holds a receiver; when all are dropped, every
    // connection has closed.
    let (open_tx, open_rx) = watch::channel(());
    loop {
        let permit = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            permit = slots.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break, // never closed
            },
        };
        let stream = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    after_accept_error(&error).await;
                    continue;
                }
            },
        };
        tokio::spawn(connection(
            stream,
            router.clone(),
            limits,
            permit,
            open_rx.clone(),
            cancel.clone(),
        ));
    }
    drop(listener);
    drop(open_rx);
    open_tx.closed().await;
}

/// One connection, served until it closes; on `cancel`, the request in
/// flight is answered and the connection closed.
async fn connection(
    stream: TcpStream,
    router: Router,
    limits: Limits,
    _permit: OwnedSemaphorePermit,
    _open: watch::Receiver<()>,
    cancel: CancellationToken,
) {
    let service = TowerToHyperService::new(router);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let mut conn = pin!(builder.serve_connection(TokioIo::new(stream), service));
    let served = tokio::select! {
        served = conn.as_mut() => served,
        () = cancel.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(error) = served {
        // A header read timeout, a client that went away, a malformed
        // request: the client's doing, not the server's.
        tracing::debug!(%error, "HTTP connection ended with an error");
    }
}

/// What an accept loop does after an accept error: nothing for one
/// connection's (it is gone; go on), and for the process's (out of file
/// descriptors) logs it and waits a second for some to close, as
/// `axum::serve` does, rather than spin.
pub async fn after_accept_error(error: &io::Error) {
    if matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(%error, "accepting a connection failed; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
