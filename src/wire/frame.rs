//! Length-prefixed framing: a 4-byte big-endian length, then that many bytes
//! of one protobuf message. Limits are enforced before any allocation, so a
//! hostile length prefix cannot make either side reserve memory.

use std::fmt;
use std::io::{self, Read, Write};

/// Bytes in the length prefix.
pub const PREFIX_LEN: usize = 4;

/// Largest request the daemon accepts. Most requests are a few hundred
/// bytes (every name is bounded, see `crate::names`); GC carries the
/// runtime's whole attachment list, about 75 bytes per kubelet attachment.
/// The plugin reads at most 1 MiB of configuration, whose attachments
/// encode smaller than their JSON, so every GC it accepts (over 10,000
/// attachments) fits; the cap still bounds what one connection can park in
/// the daemon's buffers.
pub const MAX_REQUEST_FRAME: usize = 1024 * 1024 + 64 * 1024;

/// Largest response a client accepts. Admin listings of big blocks are the
/// only large responses (a /16 of addresses is about 8 MiB).
pub const MAX_RESPONSE_FRAME: usize = 64 * 1024 * 1024;

/// A framing failure.
#[derive(Debug)]
pub enum FrameError {
    /// The length prefix announces more than the receiver accepts.
    TooLarge { len: usize, max: usize },
    /// The peer closed the stream in the middle of a frame.
    Truncated,
    /// The stream failed (including a read/write deadline passing).
    Io(io::Error),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::TooLarge { len, max } => {
                write!(f, "frame of {len} bytes exceeds the limit of {max} bytes")
            }
            FrameError::Truncated => f.write_str("connection closed in the middle of a frame"),
            FrameError::Io(err) => write!(f, "{err}"),
        }
    }
}

impl std::error::Error for FrameError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FrameError::Io(err) => Some(err),
            _ => None,
        }
    }
}

/// Prefixes `payload` with its length. Fails only if the payload is larger
/// than `max` (the receiver would refuse it anyway).
pub fn encode(payload: &[u8], max: usize) -> Result<Vec<u8>, FrameError> {
    let len = payload.len();
    let prefix = u32::try_from(len)
        .ok()
        .filter(|_| len <= max)
        .ok_or(FrameError::TooLarge { len, max })?;
    let mut frame = Vec::with_capacity(PREFIX_LEN + len);
    frame.extend_from_slice(&prefix.to_be_bytes());
    frame.extend_from_slice(payload);
    Ok(frame)
}

/// Looks for one complete frame at the start of `buf`. Returns the payload's
/// range and the total bytes the frame occupies, `None` if more bytes are
/// needed, or `TooLarge` as soon as the prefix is readable.
pub fn split(
    buf: &[u8],
    max: usize,
) -> Result<Option<(std::ops::Range<usize>, usize)>, FrameError> {
    let Some(prefix) = buf.get(..PREFIX_LEN) else {
        return Ok(None);
    };
    let mut len_bytes = [0u8; PREFIX_LEN];
    len_bytes.copy_from_slice(prefix);
    let len = usize::try_from(u32::from_be_bytes(len_bytes)).unwrap_or(usize::MAX);
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let end = PREFIX_LEN + len;
    Ok((buf.len() >= end).then_some((PREFIX_LEN..end, end)))
}

/// Writes one frame to a blocking stream.
pub fn write_frame(out: &mut impl Write, payload: &[u8], max: usize) -> Result<(), FrameError> {
    let frame = encode(payload, max)?;
    out.write_all(&frame).map_err(FrameError::Io)?;
    out.flush().map_err(FrameError::Io)
}

/// Reads one frame from a blocking stream.
pub fn read_frame(input: &mut impl Read, max: usize) -> Result<Vec<u8>, FrameError> {
    let mut prefix = [0u8; PREFIX_LEN];
    read_exact(input, &mut prefix)?;
    let len = usize::try_from(u32::from_be_bytes(prefix)).unwrap_or(usize::MAX);
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let mut payload = vec![0u8; len];
    read_exact(input, &mut payload)?;
    Ok(payload)
}

fn read_exact(input: &mut impl Read, buf: &mut [u8]) -> Result<(), FrameError> {
    input.read_exact(buf).map_err(|err| match err.kind() {
        io::ErrorKind::UnexpectedEof => FrameError::Truncated,
        _ => FrameError::Io(err),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_then_split_round_trips() {
        let frame = encode(b"hello", 16).unwrap();
        assert_eq!(&frame[..4], &[0, 0, 0, 5]);
        let (range, used) = split(&frame, 16).unwrap().unwrap();
        assert_eq!(&frame[range], b"hello");
        assert_eq!(used, 9);
    }

    #[test]
    fn split_waits_for_whole_frame() {
        let frame = encode(b"hello", 16).unwrap();
        for cut in 0..frame.len() {
            assert!(split(&frame[..cut], 16).unwrap().is_none(), "cut at {cut}");
        }
    }

    #[test]
    fn oversized_prefix_is_refused_before_payload_arrives() {
        let prefix = (1u32 << 31).to_be_bytes();
        assert!(matches!(
            split(&prefix, MAX_REQUEST_FRAME),
            Err(FrameError::TooLarge { len, .. }) if len == 1 << 31
        ));
        let mut reader: &[u8] = &prefix;
        assert!(matches!(
            read_frame(&mut reader, MAX_REQUEST_FRAME),
            Err(FrameError::TooLarge { .. })
        ));
        assert!(matches!(
            encode(&[0u8; 17], 16),
            Err(FrameError::TooLarge { len: 17, max: 16 })
        ));
    }

    #[test]
    fn empty_payload_is_a_valid_frame() {
        let frame = encode(b"", 16).unwrap();
        assert_eq!(split(&frame, 16).unwrap(), Some((4..4, 4)));
    }

    #[test]
    fn truncated_stream_is_reported() {
        let frame = encode(b"hello", 16).unwrap();
        let mut reader: &[u8] = &frame[..6];
        assert!(matches!(
            read_frame(&mut reader, 16),
            Err(FrameError::Truncated)
        ));
        let mut empty: &[u8] = &[];
        assert!(matches!(
            read_frame(&mut empty, 16),
            Err(FrameError::Truncated)
        ));
    }
}
