//! Reading the server name a TLS client asks for, from the first bytes of
//! a tunnel (its ClientHello), without taking part in the TLS session.

/// What the first bytes of a tunnel say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// Not a TLS ClientHello.
    NotTls,
    /// A ClientHello has begun; more bytes are needed.
    Incomplete,
    /// A whole ClientHello, with the server name it asks for (if any).
    Sni(Option<String>),
}

/// The most of a tunnel's first bytes read to find the ClientHello (one
/// TLS record).
pub const MAX_HELLO: usize = 5 + 16 * 1024;

/// Reads the ClientHello at the start of `bytes` (it must fit in the
/// first TLS record).
pub fn client_hello(bytes: &[u8]) -> Hello {
    let mut reader = Reader(bytes);
    // Record: handshake (22), version, length.
    let Some(header) = reader.take(5) else {
        return if bytes.is_empty() || bytes[0] == 22 { Hello::Incomplete } else { Hello::NotTls };
    };
    if header[0] != 22 || header[1] != 3 {
        return Hello::NotTls;
    }
    let record_len = usize::from(u16::from_be_bytes([header[3], header[4]]));
    let Some(record) = reader.take(record_len) else { return Hello::Incomplete };
    parse_hello(record).map(Hello::Sni).unwrap_or(Hello::NotTls)
}

/// The server name of a ClientHello handshake message; `None` when it is
/// malformed.
fn parse_hello(record: &[u8]) -> Option<Option<String>> {
    let mut r = Reader(record);
    let header = r.take(4)?;
    if header[0] != 1 {
        return None; // not a ClientHello
    }
    let len = (usize::from(header[1]) << 16) | (usize::from(header[2]) << 8) | usize::from(header[3]);
    let mut hello = Reader(r.take(len)?);
    hello.take(2 + 32)?; // version, random
    hello.vec8()?; // session id
    hello.vec16()?; // cipher suites
    hello.vec8()?; // compression methods
    if hello.0.is_empty() {
        return Some(None); // no extensions
    }
    let mut extensions = Reader(hello.vec16()?);
    while !extensions.0.is_empty() {
        let kind = extensions.u16()?;
        let body = extensions.vec16()?;
        if kind != 0 {
            continue;
        }
        // server_name: a list of (type, name); type 0 is a host name.
        let mut list = Reader(Reader(body).vec16()?);
        while !list.0.is_empty() {
            let name_type = list.take(1)?[0];
            let name = list.vec16()?;
            if name_type == 0 {
                let name = std::str::from_utf8(name).ok()?;
                return Some(Some(name.trim_end_matches('.').to_ascii_lowercase()));
            }
        }
        return Some(None);
    }
    Some(None)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = usize::from(self.take(1)?[0]);
        self.take(n)
    }

    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = usize::from(self.u16()?);
        self.take(n)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A minimal ClientHello record asking for `name` (none: no SNI).
    pub(crate) fn hello_for(name: Option<&str>) -> Vec<u8> {
        let mut extensions = Vec::new();
        if let Some(name) = name {
            let mut entry = vec![0u8];
            entry.extend_from_slice(&(name.len() as u16).to_be_bytes());
            entry.extend_from_slice(name.as_bytes());
            let mut list = (entry.len() as u16).to_be_bytes().to_vec();
            list.extend_from_slice(&entry);
            extensions.extend_from_slice(&0u16.to_be_bytes());
            extensions.extend_from_slice(&(list.len() as u16).to_be_bytes());
            extensions.extend_from_slice(&list);
        }
        // A second, unrelated extension (supported_versions).
        extensions.extend_from_slice(&[0x00, 0x2b, 0x00, 0x03, 0x02, 0x03, 0x04]);
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7u8; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one cipher suite
        body.extend_from_slice(&[1, 0]); // null compression
        body.extend_from_slice(&(extensions.len() as u16).to_be_bytes());
        body.extend_from_slice(&extensions);
        let mut handshake = vec![1, 0, (body.len() >> 8) as u8, body.len() as u8];
        handshake.extend_from_slice(&body);
        let mut record = vec![22, 3, 1, (handshake.len() >> 8) as u8, handshake.len() as u8];
        record.extend_from_slice(&handshake);
        record
    }

    #[test]
    fn the_server_name_is_read_and_anything_else_is_told_apart() {
        let hello = hello_for(Some("Pkgs.Space.Test."));
        assert_eq!(client_hello(&hello), Hello::Sni(Some("pkgs.space.test".into())));
        assert_eq!(client_hello(&hello_for(None)), Hello::Sni(None));
        for cut in [0, 1, 4, 5, hello.len() - 1] {
            assert_eq!(client_hello(&hello[..cut]), Hello::Incomplete, "cut at {cut}");
        }
        assert_eq!(client_hello(b"GET / HTTP/1.1\r\n\r\n"), Hello::NotTls);
        assert_eq!(client_hello(b"SSH-2.0-OpenSSH_9.2\r\n"), Hello::NotTls);
        let mut broken = hello.clone();
        broken[5] = 2; // a ServerHello
        assert_eq!(client_hello(&broken), Hello::NotTls);
    }
}
