//! Variable expansion in Dockerfile words, by Docker's rules (moby's
//! `shell` lexer): `$VAR`, `${VAR}`, `${VAR:-word}`, `${VAR-word}`,
//! `${VAR:+word}`, `${VAR+word}`, `${VAR:?message}`, `${VAR?message}`;
//! single quotes keep everything, double quotes keep all but `$` and the
//! escapes of `"`, `$` and the escape character; outside quotes the escape
//! character takes the next character literally. Quotes are removed.
//!
//! Which instructions expand is the planner's business: the builder expands
//! FROM, ENV, ARG, LABEL, WORKDIR, USER, EXPOSE and COPY/ADD words, never
//! RUN, CMD, ENTRYPOINT or SHELL (the shell does that in the sandbox).

use std::iter::Peekable;
use std::str::Chars;

/// Why a word could not be expanded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpandError {
    #[error("unexpected end of statement while looking for matching single-quote")]
    UnclosedSingleQuote,
    #[error("unexpected end of statement while looking for matching double-quote")]
    UnclosedDoubleQuote,
    #[error("syntax error: missing '}}'")]
    MissingBrace,
    #[error("syntax error: bad substitution")]
    BadSubstitution,
    #[error("missing ':' in substitution")]
    MissingColon,
    #[error("unsupported modifier ({0}) in substitution")]
    UnsupportedModifier(char),
    #[error("{name}: {message}")]
    Required { name: String, message: String },
    #[error("substitutions nested more than {MAX_DEPTH} deep")]
    TooDeep,
}

/// Nesting `${A:-${B:-…}}` recurses; the text is the tenant's, and a
/// stack overflow would abort the whole server.
const MAX_DEPTH: usize = 64;

/// Expands one word: variables are looked up with `lookup` (`None` =
/// unset, which `${VAR-word}` tells apart from empty).
pub fn expand<'v>(word: &str, escape: char, lookup: &dyn Fn(&str) -> Option<&'v str>) -> Result<String, ExpandError> {
    let mut lexer = Lexer { chars: word.chars().peekable(), escape, lookup, depth: 0 };
    let (out, _) = lexer.until(None)?;
    Ok(out)
}

struct Lexer<'a, 'v> {
    chars: Peekable<Chars<'a>>,
    escape: char,
    lookup: &'a dyn Fn(&str) -> Option<&'v str>,
    depth: usize,
}

impl Lexer<'_, '_> {
    /// Reads to `stop` (consumed) or the end; says whether `stop` was found.
    fn until(&mut self, stop: Option<char>) -> Result<(String, bool), ExpandError> {
        let mut out = String::new();
        while let Some(&ch) = self.chars.peek() {
            if Some(ch) == stop {
                self.chars.next();
                return Ok((out, true));
            }
            match ch {
                '\'' => out.push_str(&self.single_quoted()?),
                '"' => out.push_str(&self.double_quoted()?),
                '$' => out.push_str(&self.dollar()?),
                _ => {
                    self.chars.next();
                    if ch == self.escape {
                        // A trailing escape character is dropped.
                        match self.chars.next() {
                            Some(next) => out.push(next),
                            None => break,
                        }
                    } else {
                        out.push(ch);
                    }
                }
            }
        }
        Ok((out, false))
    }

    fn single_quoted(&mut self) -> Result<String, ExpandError> {
        self.chars.next();
        let mut out = String::new();
        loop {
            match self.chars.next() {
                None => return Err(ExpandError::UnclosedSingleQuote),
                Some('\'') => return Ok(out),
                Some(ch) => out.push(ch),
            }
        }
    }

    fn double_quoted(&mut self) -> Result<String, ExpandError> {
        self.chars.next();
        let mut out = String::new();
        loop {
            match self.chars.peek().copied() {
                None => return Err(ExpandError::UnclosedDoubleQuote),
                Some('"') => {
                    self.chars.next();
                    return Ok(out);
                }
                Some('$') => out.push_str(&self.dollar()?),
                Some(ch) => {
                    self.chars.next();
                    if ch == self.escape {
                        match self.chars.peek().copied() {
                            None => continue,
                            Some(next) if next == '"' || next == '$' || next == self.escape => {
                                self.chars.next();
                                out.push(next);
                                continue;
                            }
                            Some(_) => {}
                        }
                    }
                    out.push(ch);
                }
            }
        }
    }

    fn name(&mut self) -> String {
        let mut name = String::new();
        if let Some(&ch) = self.chars.peek() {
            if ch.is_ascii_digit() {
                while let Some(&d) = self.chars.peek().filter(|d| d.is_ascii_digit()) {
                    name.push(d);
                    self.chars.next();
                }
                return name;
            }
            if "@*#?-$!".contains(ch) {
                self.chars.next();
                return ch.to_string();
            }
        }
        while let Some(&ch) = self.chars.peek().filter(|c| c.is_alphanumeric() || **c == '_') {
            name.push(ch);
            self.chars.next();
        }
        name
    }

    fn dollar(&mut self) -> Result<String, ExpandError> {
        self.chars.next();
        if self.chars.peek() != Some(&'{') {
            let name = self.name();
            if name.is_empty() {
                return Ok("$".into());
            }
            return Ok((self.lookup)(&name).unwrap_or("").to_string());
        }
        self.chars.next();
        match self.chars.peek() {
            None => return Err(ExpandError::MissingBrace),
            Some('{' | '}' | ':') => return Err(ExpandError::BadSubstitution),
            Some(_) => {}
        }
        let name = self.name();
        let value = (self.lookup)(&name);
        match self.chars.next() {
            Some('}') => Ok(value.unwrap_or("").to_string()),
            Some(':') => {
                let modifier = self.chars.next().ok_or(ExpandError::MissingBrace)?;
                let word = self.braced_word()?;
                let set_and_not_empty = value.is_some_and(|v| !v.is_empty());
                match modifier {
                    '-' => Ok(if set_and_not_empty { value.unwrap_or("").to_string() } else { word }),
                    '+' => Ok(if set_and_not_empty { word } else { String::new() }),
                    '?' if set_and_not_empty => Ok(value.unwrap_or("").to_string()),
                    '?' => Err(ExpandError::Required { name, message: word }),
                    other => Err(ExpandError::UnsupportedModifier(other)),
                }
            }
            Some(modifier @ ('-' | '+' | '?')) => {
                let word = self.braced_word()?;
                match (modifier, value) {
                    ('-', Some(v)) | ('?', Some(v)) => Ok(v.to_string()),
                    ('-', None) => Ok(word),
                    ('+', Some(_)) => Ok(word),
                    ('+', None) => Ok(String::new()),
                    _ => Err(ExpandError::Required { name, message: word }),
                }
            }
            Some(other) if !name.is_empty() => Err(ExpandError::UnsupportedModifier(other)),
            _ => Err(ExpandError::MissingColon),
        }
    }

    fn braced_word(&mut self) -> Result<String, ExpandError> {
        if self.depth == MAX_DEPTH {
            return Err(ExpandError::TooDeep);
        }
        self.depth += 1;
        let read = self.until(Some('}'));
        self.depth -= 1;
        let (word, closed) = read?;
        if !closed {
            return Err(ExpandError::MissingBrace);
        }
        Ok(word)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(word: &str, env: &[(&str, &str)]) -> Result<String, ExpandError> {
        let lookup = |name: &str| env.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
        expand(word, '\\', &lookup)
    }

    /// moby's `envVarTest` table (the rows that apply on Unix), with the
    /// environment its test uses.
    #[test]
    fn moby_env_var_table() {
        let env = [("PWD", "/home"), ("SHELL", "bash"), ("KOREAN", "한국어"), ("NULL", "")];
        let table: &[(&str, Option<&str>)] = &[
            ("hello", Some("hello")),
            ("he'll'o", Some("hello")),
            ("he'llo", None),
            ("he\\'llo", Some("he'llo")),
            ("he\\\\'llo", None),
            ("abc\\tdef", Some("abctdef")),
            ("\"abc\\tdef\"", Some("abc\\tdef")),
            ("\"abc\\\\tdef\"", Some("abc\\tdef")),
            ("'abc\\tdef'", Some("abc\\tdef")),
            ("hello\\", Some("hello")),
            ("hello\\\\", Some("hello\\")),
            ("\"hello", None),
            ("\"hello\\\"", None),
            ("\"hel'lo\"", Some("hel'lo")),
            ("'hello", None),
            ("'hello\\'", Some("hello\\")),
            ("'hello\\there'", Some("hello\\there")),
            ("'hello\\\\there'", Some("hello\\\\there")),
            ("\"''\"", Some("''")),
            ("$.", Some("$.")),
            ("$1", Some("")),
            ("he$1x", Some("hex")),
            ("he$.x", Some("he$.x")),
            ("he$pwd.", Some("he.")),
            ("he$PWD", Some("he/home")),
            ("he\\$PWD", Some("he$PWD")),
            ("he\\\\$PWD", Some("he\\/home")),
            ("\"he\\$PWD\"", Some("he$PWD")),
            ("\"he\\\\$PWD\"", Some("he\\/home")),
            ("\\${}", Some("${}")),
            ("\\${}aaa", Some("${}aaa")),
            ("he\\${}", Some("he${}")),
            ("he\\${}xx", Some("he${}xx")),
            ("${}", None),
            ("${}aaa", None),
            ("he${}", None),
            ("he${}xx", None),
            ("he${hi}", Some("he")),
            ("he${hi}xx", Some("hexx")),
            ("he${PWD}", Some("he/home")),
            ("he${.}", None),
            ("he${XXX:-000}xx", Some("he000xx")),
            ("he${PWD:-000}xx", Some("he/homexx")),
            ("he${XXX:-$PWD}xx", Some("he/homexx")),
            ("he${XXX:-${PWD:-yyy}}xx", Some("he/homexx")),
            ("he${XXX:-${YYY:-yyy}}xx", Some("heyyyxx")),
            ("he${XXX:YYY}", None),
            ("he${XXX:+${PWD}}xx", Some("hexx")),
            ("he${PWD:+${XXX}}xx", Some("hexx")),
            ("he${PWD:+${SHELL}}xx", Some("hebashxx")),
            ("he${XXX:+000}xx", Some("hexx")),
            ("he${PWD:+000}xx", Some("he000xx")),
            ("'he${XX}'", Some("he${XX}")),
            ("\"he${PWD}\"", Some("he/home")),
            ("\"he'$PWD'\"", Some("he'/home'")),
            ("\"$PWD\"", Some("/home")),
            ("'$PWD'", Some("$PWD")),
            ("'\\$PWD'", Some("\\$PWD")),
            ("'\"hello\"'", Some("\"hello\"")),
            ("'he\\$PWD'", Some("he\\$PWD")),
            ("he${PWD", None),
            ("he${PWD:=000}xx", None),
            ("he${PWD:+${PWD}:}xx", Some("he/home:xx")),
            ("he${XXX:-\\$PWD:}xx", Some("he$PWD:xx")),
            ("he${XXX:-\\${PWD}z}xx", Some("he${PWDz}xx")),
            ("안녕하세요", Some("안녕하세요")),
            ("안'녕'하세요", Some("안녕하세요")),
            ("안'녕하세요", None),
            ("안녕\\'하세요", Some("안녕'하세요")),
            ("\"안녕'하세요\"", Some("안녕'하세요")),
            ("안녕${XXX:-${YYY:-yyy}}xx", Some("안녕yyyxx")),
            ("$KOREAN", Some("한국어")),
            ("안녕$KOREAN", Some("안녕한국어")),
            ("${{aaa}", None),
            ("${aaa}}", Some("}")),
            ("${aaa", None),
            ("${{aaa:-bbb}", None),
            ("${aaa:-bbb}}", Some("bbb}")),
            ("${aaa:-bbb", None),
            ("${aaa:-bbb}", Some("bbb")),
            ("${aaa:-${bbb:-ccc}}", Some("ccc")),
            ("${aaa:-bbb ${foo}", None),
            ("${aaa:-bbb {foo}", Some("bbb {foo")),
            ("${:}", None),
            ("${:-bbb}", None),
            ("${:+bbb}", None),
        ];
        for (word, want) in table {
            let got = run(word, &env);
            match want {
                Some(want) => assert_eq!(got.as_deref(), Ok(*want), "expanding {word:?}"),
                None => assert!(got.is_err(), "expanding {word:?} should fail, gave {got:?}"),
            }
        }
    }

    /// buildkit's `ProcessWithMatches` cases for the modifiers without a
    /// colon, which tell an unset variable from an empty one.
    #[test]
    fn unset_and_empty_differ_without_colon() {
        let env = [("FOO", "xxx"), ("BAR", "")];
        assert_eq!(run("${FOO-aaa} ${BAR-bbb} ${BAZ-ccc}", &env).unwrap(), "xxx  ccc");
        assert_eq!(run("${FOO:-aaa} ${BAR:-bbb} ${BAZ:-ccc}", &env).unwrap(), "xxx bbb ccc");
        assert_eq!(run("${FOO+aaa} ${BAR+bbb} ${BAZ+ccc}", &env).unwrap(), "aaa bbb ");
        assert_eq!(run("${FOO:+aaa} ${BAR:+bbb} ${BAZ:+ccc}", &env).unwrap(), "aaa  ");
        assert_eq!(run("${FOO?aaa}", &env).unwrap(), "xxx");
        assert_eq!(run("${BAR?bbb}", &env).unwrap(), "");
        assert!(run("${BAZ?ccc}", &env).is_err());
        assert!(run("${BAR:?bbb}", &env).is_err());
        let err = run("${BAZ:?set BAZ$FOO}", &env).unwrap_err();
        assert_eq!(err.to_string(), "BAZ: set BAZxxx");
        assert!(run("${FOO=aaa}", &env).is_err());
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        let deep = format!("{}x{}", "${A:-".repeat(100_000), "}".repeat(100_000));
        assert_eq!(run(&deep, &[]), Err(ExpandError::TooDeep));
        let fine = format!("{}x{}", "${A:-".repeat(MAX_DEPTH), "}".repeat(MAX_DEPTH));
        assert_eq!(run(&fine, &[]).unwrap(), "x");
    }

    #[test]
    fn the_escape_directive_changes_the_escape_character() {
        let env = [("PWD", "/home")];
        let lookup = |name: &str| env.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
        assert_eq!(expand("he`$PWD", '`', &lookup).unwrap(), "he$PWD");
        assert_eq!(expand("c:\\$PWD", '`', &lookup).unwrap(), "c:\\/home");
        assert_eq!(expand("\"a`\"b\"", '`', &lookup).unwrap(), "a\"b");
    }
}
