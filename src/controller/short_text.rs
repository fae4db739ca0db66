//! Text the controller keeps for every block that is short by nature (a
//! CIDR, a network, a pool's name, a reason, a resourceVersion) or copied
//! into many maps (a node's name): up to 22 bytes are kept inline, longer
//! text on the heap, shared by its clones. A `Box<str>` of a few bytes
//! costs a 32-byte allocation besides its pointer; a cloud's node names
//! (`ip-10-0-1-23.us-west-2.compute.internal`) are longer than 22 bytes.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The longest text kept inline: the enum stays 24 bytes.
const INLINE: usize = 22;

#[derive(Clone)]
pub enum ShortText {
    Inline {
        len: u8,
        bytes: [u8; INLINE],
    },
    /// Shared by clones: one copy of a long node name serves every map.
    Heap(Arc<str>),
}

impl ShortText {
    pub fn new(text: &str) -> ShortText {
        match u8::try_from(text.len()) {
            Ok(len) if text.len() <= INLINE => {
                let mut bytes = [0; INLINE];
                bytes[..text.len()].copy_from_slice(text.as_bytes());
                ShortText::Inline { len, bytes }
            }
            _ => ShortText::Heap(Arc::from(text)),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            // Always whole UTF-8: the bytes were copied from a `&str`.
            ShortText::Inline { len, bytes } => (bytes.get(..usize::from(*len)))
                .and_then(|b| std::str::from_utf8(b).ok())
                .unwrap_or_default(),
            ShortText::Heap(text) => text,
        }
    }
}

impl Default for ShortText {
    fn default() -> Self {
        ShortText::new("")
    }
}

impl Deref for ShortText {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for ShortText {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl From<&str> for ShortText {
    fn from(text: &str) -> Self {
        ShortText::new(text)
    }
}

impl From<String> for ShortText {
    fn from(text: String) -> Self {
        ShortText::new(&text)
    }
}

impl PartialEq for ShortText {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for ShortText {}

impl PartialEq<str> for ShortText {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for ShortText {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialOrd for ShortText {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ShortText {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl fmt::Debug for ShortText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for ShortText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ShortText {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ShortText {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(ShortText::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Text of every length comes back as it went in, inline up to 22
    /// bytes (multi-byte characters included), and compares as text.
    #[test]
    fn short_text_is_its_text() {
        for text in [
            "",
            "default",
            "198.18.0.0/29",
            "é".repeat(11).as_str(),
            "x".repeat(23).as_str(),
        ] {
            let kept = ShortText::from(text);
            assert_eq!(kept.as_str(), text);
            assert_eq!(
                matches!(kept, ShortText::Inline { .. }),
                text.len() <= INLINE,
                "{text}"
            );
            let json = serde_json::to_string(&kept).unwrap();
            assert_eq!(serde_json::from_str::<ShortText>(&json).unwrap(), kept);
        }
        assert_eq!(std::mem::size_of::<ShortText>(), 24);
        let long = ShortText::from("ip-10-0-1-23.us-west-2.compute.internal");
        let copy = long.clone();
        assert!(
            std::ptr::eq(long.as_str(), copy.as_str()),
            "a clone shares the text"
        );
        let (a, b) = (ShortText::from("a"), ShortText::from("b"));
        assert!(a < b && b == *"b");
        assert!(serde_json::from_str::<ShortText>("7").is_err());
    }
}
