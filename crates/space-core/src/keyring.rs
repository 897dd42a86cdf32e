//! The node's keyring: seals tenant secrets and sandbox CA keys
//! (AES-256-GCM) and derives its tokens, from one key in the data dir.

use std::path::Path;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};

/// The key that seals secrets (and each sandbox's CA key).
pub struct Keyring {
    key: LessSafeKey,
    /// Derives per-object tokens (never the sealing key itself).
    tokens: ring::hmac::Key,
}

impl Keyring {
    /// Reads `path`, or makes it (32 random bytes, 0600) if it is missing.
    pub fn load_or_create(path: &Path) -> std::io::Result<Keyring> {
        // Its first users may come at once (a warm pool's members, the
        // first requests): one makes it, the others read that one.
        let mut bytes = space_host::datadir::create_once(path, 0o600, || {
            let mut bytes = vec![0u8; 32];
            SystemRandom::new().fill(&mut bytes).map_err(|_| std::io::Error::other("no random bytes"))?;
            Ok(bytes)
        })?;
        // Also 64 hexadecimal digits (a key an operator made as text).
        let text = String::from_utf8_lossy(&bytes).trim().to_string();
        if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
            bytes = (0..32).map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).unwrap_or(0)).collect();
        }
        let key = UnboundKey::new(&AES_256_GCM, &bytes)
            .map_err(|_| std::io::Error::other(format!("{}: not a 32-byte key (nor 64 hex digits)", path.display())))?;
        let derived = ring::hmac::sign(&ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &bytes), b"space tokens v1");
        let tokens = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, derived.as_ref());
        Ok(Keyring { key: LessSafeKey::new(key), tokens })
    }

    /// A token for `purpose` and `id` that only this key can make: stable
    /// across restarts, unguessable without the key file.
    pub fn token(&self, purpose: &str, id: &str) -> String {
        let tag = ring::hmac::sign(&self.tokens, format!("{purpose}\0{id}").as_bytes());
        tag.as_ref()[..24].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// `plain` sealed for `context` (nonce, then ciphertext and tag).
    pub fn seal(&self, context: &str, plain: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new().fill(&mut nonce).expect("the kernel's random source");
        let mut sealed = plain.to_vec();
        self.key
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(context.as_bytes()), &mut sealed)
            .expect("sealing");
        let mut out = nonce.to_vec();
        out.extend_from_slice(&sealed);
        out
    }

    /// What [`Keyring::seal`] sealed for the same `context`.
    pub fn open(&self, context: &str, sealed: &[u8]) -> Option<Vec<u8>> {
        if sealed.len() < NONCE_LEN {
            return None;
        }
        let (nonce, rest) = sealed.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut rest = rest.to_vec();
        let plain = self.key.open_in_place(nonce, Aad::from(context.as_bytes()), &mut rest).ok()?;
        Some(plain.to_vec())
    }
}
