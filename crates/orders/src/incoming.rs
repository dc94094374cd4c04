//! The gRPC listener's connections, bounded: a cap on how many are open at
//! once, and a deadline for the HTTP/2 connection preface.
//!
//! tonic bounds a connection once HTTP/2 is up (a request timeout, streams
//! per connection, keepalive PINGs a wedged peer cannot answer), not before:
//! hyper's HTTP/2 handshake waits for the client's preface with no timeout,
//! so a client sending it a byte a second, or nothing, held its connection
//! for good, and nothing capped how many it opened.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tonic::transport::server::{Connected, TcpIncoming};

/// The HTTP/2 connection preface's length (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`),
/// the first bytes a client sends.
const PREFACE_BYTES: usize = 24;

/// The connections accepted on `listener`, at most `max_connections` open at
/// once (at the cap none is accepted until one closes: new clients wait in
/// the kernel's accept backlog), each with TCP keepalive after
/// `tcp_keepalive` idle and `preface_timeout` from accept to send the
/// HTTP/2 preface.
pub fn bounded(
    listener: TcpListener,
    max_connections: usize,
    preface_timeout: Duration,
    tcp_keepalive: Duration,
) -> impl Stream<Item = io::Result<Bounded<TcpStream>>> {
    let incoming = TcpIncoming::from(listener).with_keepalive(Some(tcp_keepalive));
    let slots = Arc::new(Semaphore::new(max_connections.max(1)));
    futures::stream::unfold((incoming, slots), move |(mut incoming, slots)| async move {
        // The slot first: at the cap, the next connection stays in the
        // backlog.
        let permit = slots.clone().acquire_owned().await.ok()?;
        let accepted = match incoming.next().await? {
            Ok(stream) => Ok(Bounded::new(stream, permit, preface_timeout)),
            Err(error) => {
                pipeline::serve::after_accept_error(&error).await;
                Err(error)
            }
        };
        Some((accepted, (incoming, slots)))
    })
}

/// An accepted connection: holds its slot until dropped, and fails its
/// reads once the preface is late.
#[derive(Debug)]
pub struct Bounded<IO> {
    io: IO,
    /// The preface's deadline and how many of its bytes are still to come;
    /// `None` once it has arrived.
    preface: Option<(Pin<Box<Sleep>>, usize)>,
    _slot: OwnedSemaphorePermit,
}

impl<IO> Bounded<IO> {
    fn new(io: IO, slot: OwnedSemaphorePermit, preface_timeout: Duration) -> Self {
        Self {
            io,
            preface: Some((Box::pin(tokio::time::sleep(preface_timeout)), PREFACE_BYTES)),
            _slot: slot,
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Bounded<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some((deadline, _)) = &mut this.preface
            && deadline.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the HTTP/2 preface did not arrive within the header read timeout",
            )));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Some((_, remaining)) = &mut this.preface {
            *remaining = remaining.saturating_sub(buf.filled().len() - before);
            if *remaining == 0 {
                this.preface = None;
            }
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Bounded<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: Connected> Connected for Bounded<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}
