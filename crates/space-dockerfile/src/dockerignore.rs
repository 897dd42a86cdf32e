//! `.dockerignore`: which context paths COPY and ADD may not see, by moby's
//! `patternmatcher` rules. Each line is a pattern (`#` starts a comment
//! line, blank lines are skipped, a leading `/` or `./` is dropped, the
//! pattern is cleaned); `!` re-includes; the last pattern that matches a
//! path or one of its parent directories decides.

use crate::glob::{self, BadPattern, Token};

/// Why a `.dockerignore` is not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IgnoreError {
    #[error("line {line}: illegal exclusion pattern: \"!\"")]
    LoneBang { line: usize },
    #[error("line {line}: {source}")]
    BadPattern {
        line: usize,
        #[source]
        source: BadPattern,
    },
}

/// A parsed `.dockerignore`.
#[derive(Debug, Clone, Default)]
pub struct Ignore {
    patterns: Vec<Pattern>,
}

#[derive(Debug, Clone)]
struct Pattern {
    cleaned: String,
    exclusion: bool,
    kind: Kind,
}

/// moby picks the cheapest test a pattern allows; the kinds are kept
/// because `**name` as a suffix test also matches `xname`, unlike a regexp.
#[derive(Debug, Clone)]
enum Kind {
    Exact,
    Prefix(String),
    Suffix(String),
    Tokens(Vec<Token>),
}

impl Ignore {
    /// Parses the text of a `.dockerignore`.
    pub fn parse(text: &str) -> Result<Ignore, IgnoreError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut patterns = Vec::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            if raw.starts_with('#') {
                continue;
            }
            let mut pattern = raw.trim();
            if pattern.is_empty() {
                continue;
            }
            let exclusion = pattern.starts_with('!');
            if exclusion {
                pattern = pattern[1..].trim();
                if pattern.is_empty() {
                    return Err(IgnoreError::LoneBang { line });
                }
            }
            let mut cleaned = glob::clean(pattern);
            if cleaned.len() > 1 && cleaned.starts_with('/') {
                cleaned.remove(0);
            }
            let kind = kind(&cleaned).map_err(|source| IgnoreError::BadPattern { line, source })?;
            patterns.push(Pattern { cleaned, exclusion, kind });
        }
        Ok(Ignore { patterns })
    }

    /// Parses patterns given one per item, as the API may pass them.
    pub fn from_patterns<'a>(patterns: impl IntoIterator<Item = &'a str>) -> Result<Ignore, IgnoreError> {
        Ignore::parse(&patterns.into_iter().collect::<Vec<_>>().join("\n"))
    }

    /// Whether COPY and ADD must not see `path` (relative to the context
    /// root; a leading `/` or `./` and a trailing `/` are ignored).
    pub fn is_excluded(&self, path: &str) -> bool {
        let path = glob::clean(path.trim_start_matches('/'));
        if path == "." {
            return false;
        }
        let parents: Vec<&str> = path.match_indices('/').map(|(at, _)| &path[..at]).collect();
        let mut excluded = false;
        for pattern in &self.patterns {
            // An inclusion cannot change an excluded path, nor an
            // exclusion an included one.
            if pattern.exclusion != excluded {
                continue;
            }
            let hit = pattern.matches(&path) || parents.iter().any(|parent| pattern.matches(parent));
            if hit {
                excluded = !pattern.exclusion;
            }
        }
        excluded
    }

    /// Whether a client packing the context sends `path`: what is not
    /// excluded, and always the Dockerfile and the `.dockerignore` itself,
    /// which the build needs even when they exclude themselves from COPY.
    pub fn sends(&self, path: &str, dockerfile: &str) -> bool {
        let cleaned = glob::clean(path.trim_start_matches('/'));
        cleaned == ".dockerignore"
            || cleaned == glob::clean(dockerfile.trim_start_matches('/'))
            || !self.is_excluded(path)
    }

    /// The patterns, cleaned, with `!` on re-inclusions.
    pub fn patterns(&self) -> Vec<String> {
        self.patterns.iter().map(|p| if p.exclusion { format!("!{}", p.cleaned) } else { p.cleaned.clone() }).collect()
    }
}

impl Pattern {
    fn matches(&self, path: &str) -> bool {
        match &self.kind {
            Kind::Exact => path == self.cleaned,
            Kind::Prefix(prefix) => path.starts_with(prefix.as_str()),
            Kind::Suffix(suffix) => {
                path.ends_with(suffix.as_str()) || suffix.strip_prefix('/').is_some_and(|rest| path == rest)
            }
            Kind::Tokens(tokens) => glob::matches(tokens, path),
        }
    }
}

/// Sorts a cleaned pattern the way moby's `Pattern.compile` does.
fn kind(cleaned: &str) -> Result<Kind, BadPattern> {
    let tokens = glob::compile(cleaned, true)?;
    let literal_rest = |rest: &[Token]| rest.iter().all(|t| matches!(t, Token::Literal(_)));
    // An escape makes moby use a regexp even for a literal.
    let escaped = cleaned.contains('\\');
    Ok(match tokens.split_first() {
        _ if escaped => Kind::Tokens(tokens),
        _ if literal_rest(&tokens) => Kind::Exact,
        Some((Token::Everything, [])) => Kind::Suffix(String::new()),
        Some((Token::Dirs, rest)) if literal_rest(rest) => Kind::Suffix(cleaned[2..].to_string()),
        _ => match tokens.split_last() {
            Some((Token::Everything, rest)) if literal_rest(rest) => {
                Kind::Prefix(cleaned.trim_end_matches('*').to_string())
            }
            _ => Kind::Tokens(tokens),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn excluded(patterns: &[&str], path: &str) -> bool {
        Ignore::from_patterns(patterns.iter().copied()).unwrap().is_excluded(path)
    }

    /// moby's `TestMatches` table, read with `MatchesOrParentMatches`
    /// (what a build uses): "exact" and "inexact" rows are excluded paths.
    #[test]
    fn moby_matches_table() {
        let table: &[(&str, &str, bool)] = &[
            ("**", "file", true),
            ("**", "file/", true),
            ("**/", "file", true),
            ("**/", "file/", true),
            ("**", "dir/file", true),
            ("**/", "dir/file", true),
            ("**", "dir/file/", true),
            ("**/", "dir/file/", true),
            ("**/**", "dir/file", true),
            ("**/**", "dir/file/", true),
            ("dir/**", "dir/file", true),
            ("dir/**", "dir/file/", true),
            ("dir/**", "dir/dir2/file", true),
            ("dir/**", "dir/dir2/file/", true),
            ("**/dir", "dir", true),
            ("**/dir", "dir/file", true),
            ("**/dir2/*", "dir/dir2/file", true),
            ("**/dir2/*", "dir/dir2/file/", true),
            ("**/dir2/**", "dir/dir2/dir3/file", true),
            ("**/dir2/**", "dir/dir2/dir3/file/", true),
            ("**file", "file", true),
            ("**file", "dir/file", true),
            ("**/file", "dir/file", true),
            ("**file", "dir/dir/file", true),
            ("**/file", "dir/dir/file", true),
            ("**/file*", "dir/dir/file", true),
            ("**/file*", "dir/dir/file.txt", true),
            ("**/file*txt", "dir/dir/file.txt", true),
            ("**/file*.txt", "dir/dir/file.txt", true),
            ("**/file*.txt*", "dir/dir/file.txt", true),
            ("**/**/*.txt", "dir/dir/file.txt", true),
            ("**/**/*.txt2", "dir/dir/file.txt", false),
            ("**/*.txt", "file.txt", true),
            ("**/**/*.txt", "file.txt", true),
            ("a**/*.txt", "a/file.txt", true),
            ("a**/*.txt", "a/dir/file.txt", true),
            ("a**/*.txt", "a/dir/dir/file.txt", true),
            ("a/*.txt", "a/dir/file.txt", false),
            ("a/*.txt", "a/file.txt", true),
            ("a/*.txt**", "a/file.txt", true),
            ("a[b-d]e", "ae", false),
            ("a[b-d]e", "ace", true),
            ("a[b-d]e", "aae", false),
            ("a[^b-d]e", "aze", true),
            (".*", ".foo", true),
            (".*", "foo", false),
            ("abc.def", "abcdef", false),
            ("abc.def", "abc.def", true),
            ("abc.def", "abcZdef", false),
            ("abc?def", "abcZdef", true),
            ("abc?def", "abcdef", false),
            ("**/foo/bar", "foo/bar", true),
            ("**/foo/bar", "dir/foo/bar", true),
            ("**/foo/bar", "dir/dir2/foo/bar", true),
            ("abc/**", "abc", false),
            ("abc/**", "abc/def", true),
            ("abc/**", "abc/def/ghi", true),
            ("**/.foo", ".foo", true),
            ("**/.foo", "bar.foo", false),
            ("a(b)c/def", "a(b)c/def", true),
            ("a(b)c/def", "a(b)c/xyz", false),
            ("a.|)$(}+{bc", "a.|)$(}+{bc", true),
            (
                "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl",
                "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl",
                true,
            ),
            ("dist/*.whl", "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl", true),
            ("a\\\\", "a\\", true),
            ("a\\*b", "a*b", true),
        ];
        for (pattern, path, want) in table {
            assert_eq!(excluded(&[pattern], path), *want, "pattern {pattern:?} on {path:?}");
        }
    }

    /// moby's multi-pattern rows and its single-purpose tests.
    #[test]
    fn last_match_wins_and_bang_reincludes() {
        assert!(!excluded(&["**", "!util/docker/web"], "util/docker/web/foo"));
        assert!(excluded(&["**", "!util/docker/web", "util/docker/web/foo"], "util/docker/web/foo"));
        assert!(!excluded(
            &["**", "!dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl"],
            "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl"
        ));
        assert!(!excluded(&["**", "!dist/*.whl"], "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl"));
        assert!(excluded(&["*"], "fileutils.go"));
        assert!(excluded(&["*.go"], "fileutils.go"));
        assert!(excluded(&["!fileutils.go", "*.go"], "fileutils.go"));
        assert!(!excluded(&["*.go", "!fileutils.go"], "fileutils.go"));
        assert!(!excluded(&["docs", "!docs/README.md"], "docs/README.md"));
        assert!(!excluded(&["docs/", "!docs/README.md"], "docs/README.md"));
        assert!(!excluded(&["docs/*", "!docs/README.md"], "docs/README.md"));
        assert!(excluded(&["docs", "!docs/README.md"], "docs/other.md"));
        assert!(!excluded(&["*.go"], "."));
        assert!(!excluded(&[], "any/path/there"));
        // A parent directory's match excludes what is under it.
        assert!(excluded(&["a*"], "ab/c"));
        assert!(excluded(&["node_modules"], "node_modules/x/y.js"));
        assert!(!excluded(&["node_modules"], "src/node_modules_list.txt"));
        // moby tests `**name` as a plain suffix, so it also takes `xname`.
        assert!(excluded(&["**file"], "xfile"));
        assert!(!excluded(&["**/file"], "xfile"));
    }

    /// moby's `ignorefile.ReadAll` case: comments, blank lines, leading `/`
    /// and spaces after `!` are cleaned away; a lone `!` is refused.
    #[test]
    fn parse_cleans_like_moby() {
        let text =
            "test1\n/test2\n/a/file/here\n\nlastfile\n# this is a comment\n! /inverted/abs/path\n  ./dot/../x/ \n";
        let ignore = Ignore::parse(text).unwrap();
        assert_eq!(ignore.patterns(), ["test1", "test2", "a/file/here", "lastfile", "!inverted/abs/path", "x"]);
        assert_eq!(Ignore::parse("a\n!\n").unwrap_err(), IgnoreError::LoneBang { line: 2 });
        assert_eq!(Ignore::parse("! ").unwrap_err(), IgnoreError::LoneBang { line: 1 });
        let bad = Ignore::parse("ok\n[\n").unwrap_err();
        assert!(matches!(bad, IgnoreError::BadPattern { line: 2, .. }), "{bad:?}");
        assert!(Ignore::parse("\u{feff}# comment\nx").unwrap().is_excluded("x"));
        // Leading "/" and "./" on the path being checked do not matter.
        assert!(ignore.is_excluded("/test2"));
        assert!(ignore.is_excluded("./a/file/here/below"));
    }

    #[test]
    fn the_dockerfile_and_dockerignore_are_still_sent() {
        let ignore = Ignore::parse("*\n").unwrap();
        assert!(ignore.is_excluded("Dockerfile"));
        assert!(ignore.sends("Dockerfile", "Dockerfile"));
        assert!(ignore.sends(".dockerignore", "Dockerfile"));
        assert!(ignore.sends("build/app.Dockerfile", "./build/app.Dockerfile"));
        assert!(!ignore.sends("main.rs", "Dockerfile"));
    }
}
