//! Path patterns: Go's `filepath.Match` syntax (`*`, `?`, `[...]`, `\`
//! escapes), which COPY sources use, plus moby's `**` for `.dockerignore`.
//! Compiled into tokens matched by a small dynamic programme, so a hostile
//! pattern costs at most pattern × path steps.

/// A pattern that is not well formed (Go's `filepath.ErrBadPattern`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("syntax error in pattern {0:?}")]
pub struct BadPattern(pub String);

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Token {
    Literal(char),
    /// `*`: any run of characters but `/`.
    Star,
    /// `?`: one character but `/`.
    Any,
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    /// `**` at the end: anything, `/` included.
    Everything,
    /// `**` before more pattern: any number of leading directories, `(.*/)?`.
    Dirs,
}

/// Compiles `pattern`; `double_star` turns on moby's `**` (else `**` is two `*`).
pub(crate) fn compile(pattern: &str, double_star: bool) -> Result<Vec<Token>, BadPattern> {
    let bad = || BadPattern(pattern.to_string());
    let chars: Vec<char> = pattern.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let ch = chars[i];
        i += 1;
        match ch {
            '*' if double_star && chars.get(i) == Some(&'*') => {
                i += 1;
                if chars.get(i) == Some(&'/') {
                    i += 1;
                }
                tokens.push(if i == chars.len() { Token::Everything } else { Token::Dirs });
            }
            '*' => tokens.push(Token::Star),
            '?' => tokens.push(Token::Any),
            '\\' => match chars.get(i) {
                Some(&next) => {
                    i += 1;
                    tokens.push(Token::Literal(next));
                }
                None => return Err(bad()),
            },
            '[' => {
                let (token, next) = class(&chars, i).ok_or_else(bad)?;
                tokens.push(token);
                i = next;
            }
            _ => tokens.push(Token::Literal(ch)),
        }
    }
    Ok(tokens)
}

/// Parses a class after its `[` by `filepath.Match`'s rules: not empty,
/// `-` and `]` only escaped or as a range's end; returns the index after `]`.
fn class(chars: &[char], mut i: usize) -> Option<(Token, usize)> {
    let negated = chars.get(i) == Some(&'^');
    if negated {
        i += 1;
    }
    let mut ranges = Vec::new();
    loop {
        if chars.get(i) == Some(&']') && !ranges.is_empty() {
            return Some((Token::Class { negated, ranges }, i + 1));
        }
        let (lo, next) = class_char(chars, i)?;
        i = next;
        let mut hi = lo;
        if chars.get(i) == Some(&'-') {
            let (end, next) = class_char(chars, i + 1)?;
            hi = end;
            i = next;
            if hi < lo {
                return None;
            }
        }
        ranges.push((lo, hi));
    }
}

fn class_char(chars: &[char], i: usize) -> Option<(char, usize)> {
    match chars.get(i)? {
        '-' | ']' => None,
        '\\' => chars.get(i + 1).map(|&c| (c, i + 2)),
        &c => Some((c, i + 1)),
    }
}

/// Whether all of `text` matches `tokens`.
pub(crate) fn matches(tokens: &[Token], text: &str) -> bool {
    let text: Vec<char> = text.chars().collect();
    // row[j]: tokens[i..] matches text[j..]; filled from the last token back.
    let mut next_row: Vec<bool> = (0..=text.len()).map(|j| j == text.len()).collect();
    for token in tokens.iter().rev() {
        let mut row = vec![false; text.len() + 1];
        for j in (0..=text.len()).rev() {
            let here = text.get(j).copied();
            row[j] = match token {
                Token::Literal(c) => here == Some(*c) && next_row[j + 1],
                Token::Any => here.is_some_and(|c| c != '/') && next_row[j + 1],
                Token::Class { negated, ranges } => {
                    here.is_some_and(|c| ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != *negated)
                        && next_row[j + 1]
                }
                Token::Star => next_row[j] || (here.is_some_and(|c| c != '/') && row[j + 1]),
                Token::Everything => next_row[j] || (here.is_some() && row[j + 1]),
                Token::Dirs => next_row[j] || (j..text.len()).any(|k| text[k] == '/' && next_row[k + 1]),
            };
        }
        next_row = row;
    }
    next_row[0]
}

/// Go's `path.Clean`: one `/` between names, no `.`, `..` resolved where
/// it can be (kept at the front of a relative path), "." for nothing.
pub(crate) fn clean(path: &str) -> String {
    let rooted = path.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => match parts.last() {
                Some(&last) if last != ".." => {
                    parts.pop();
                }
                _ if rooted => {}
                _ => parts.push(".."),
            },
            _ => parts.push(part),
        }
    }
    let joined = parts.join("/");
    match (rooted, joined.is_empty()) {
        (true, _) => format!("/{joined}"),
        (false, true) => ".".into(),
        (false, false) => joined,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn go_match(pattern: &str, text: &str) -> Result<bool, BadPattern> {
        Ok(matches(&compile(pattern, false)?, text))
    }

    /// Go's `filepath.Match` table, as moby's patternmatcher tests carry it.
    #[test]
    fn go_filepath_match_table() {
        let table: &[(&str, &str, Option<bool>)] = &[
            ("abc", "abc", Some(true)),
            ("*", "abc", Some(true)),
            ("*c", "abc", Some(true)),
            ("a*", "a", Some(true)),
            ("a*", "abc", Some(true)),
            ("a*", "ab/c", Some(false)),
            ("a*/b", "abc/b", Some(true)),
            ("a*/b", "a/c/b", Some(false)),
            ("a*b*c*d*e*/f", "axbxcxdxe/f", Some(true)),
            ("a*b*c*d*e*/f", "axbxcxdxexxx/f", Some(true)),
            ("a*b*c*d*e*/f", "axbxcxdxe/xxx/f", Some(false)),
            ("a*b*c*d*e*/f", "axbxcxdxexxx/fff", Some(false)),
            ("a*b?c*x", "abxbbxdbxebxczzx", Some(true)),
            ("a*b?c*x", "abxbbxdbxebxczzy", Some(false)),
            ("ab[c]", "abc", Some(true)),
            ("ab[b-d]", "abc", Some(true)),
            ("ab[e-g]", "abc", Some(false)),
            ("ab[^c]", "abc", Some(false)),
            ("ab[^b-d]", "abc", Some(false)),
            ("ab[^e-g]", "abc", Some(true)),
            ("a\\*b", "a*b", Some(true)),
            ("a\\*b", "ab", Some(false)),
            ("a?b", "a☺b", Some(true)),
            ("a[^a]b", "a☺b", Some(true)),
            ("a???b", "a☺b", Some(false)),
            ("a[^a][^a][^a]b", "a☺b", Some(false)),
            ("[a-ζ]*", "α", Some(true)),
            ("*[a-ζ]", "A", Some(false)),
            ("a?b", "a/b", Some(false)),
            ("a*b", "a/b", Some(false)),
            ("[\\]a]", "]", Some(true)),
            ("[\\-]", "-", Some(true)),
            ("[x\\-]", "x", Some(true)),
            ("[x\\-]", "-", Some(true)),
            ("[x\\-]", "z", Some(false)),
            ("[\\-x]", "x", Some(true)),
            ("[\\-x]", "-", Some(true)),
            ("[\\-x]", "a", Some(false)),
            ("[]a]", "]", None),
            ("[-]", "-", None),
            ("[x-]", "x", None),
            ("[-x]", "x", None),
            ("\\", "a", None),
            ("[a-b-c]", "a", None),
            ("[", "a", None),
            ("[^", "a", None),
            ("[^bc", "a", None),
            ("a[", "a", None),
            ("*x", "xxx", Some(true)),
        ];
        for (pattern, text, want) in table {
            let got = go_match(pattern, text).ok();
            assert_eq!(got, *want, "pattern {pattern:?} on {text:?}");
        }
    }

    #[test]
    fn clean_follows_go() {
        for (path, want) in [
            ("", "."),
            ("./a//b/", "a/b"),
            ("/../a", "/a"),
            ("../a/../../b", "../../b"),
            ("a/./b/../c", "a/c"),
            ("/", "/"),
            ("docs/", "docs"),
        ] {
            assert_eq!(clean(path), want, "clean({path:?})");
        }
    }
}
