//! Splitting instruction arguments the way buildkit's line parsers do,
//! before expansion: quotes and escapes stay in the words (expansion
//! removes them), only unquoted white space separates.

/// buildkit's `parseWords`.
pub(crate) fn split_words(text: &str, escape: char) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    // A quoted empty string ("") is still a word.
    let mut quoted = false;
    let mut quote: Option<char> = None;
    let mut chars = text.chars().peekable();
    while let Some(ch) = chars.next() {
        match quote {
            None if ch.is_whitespace() => {
                if quoted || !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
                quoted = false;
            }
            None => {
                if ch == '\'' || ch == '"' {
                    quote = Some(ch);
                    quoted = true;
                }
                if ch == escape {
                    if let Some(next) = chars.next() {
                        word.push(ch);
                        word.push(next);
                    }
                    continue;
                }
                word.push(ch);
            }
            Some(q) => {
                if ch == q {
                    quote = None;
                } else if ch == escape && q != '\'' {
                    if let Some(next) = chars.next() {
                        word.push(ch);
                        word.push(next);
                    }
                    continue;
                }
                word.push(ch);
            }
        }
    }
    if quoted || !word.is_empty() {
        words.push(word);
    }
    words
}

/// `NAME=value` pairs of ENV and LABEL, and the old `NAME value` form
/// (the first word has no `=`: the rest of the line is the value).
pub(crate) fn name_values(text: &str, escape: char) -> Result<Vec<(String, String)>, String> {
    let words = split_words(text, escape);
    let Some(first) = words.first() else {
        return Err("needs NAME=value".into());
    };
    if !first.contains('=') {
        let text = text.trim();
        let Some((name, value)) = text.split_once(char::is_whitespace) else {
            return Err(format!("needs a value for {text:?}"));
        };
        return Ok(vec![(name.to_string(), value.trim_start().to_string())]);
    }
    words
        .into_iter()
        .map(|word| match word.split_once('=') {
            Some((name, value)) => Ok((name.to_string(), value.to_string())),
            None => Err(format!("can't find = in {word:?}: must be of the form name=value")),
        })
        .collect()
}

/// ARG's `NAME[=default]` words.
pub(crate) fn arg_names(text: &str, escape: char) -> Vec<(String, Option<String>)> {
    split_words(text, escape)
        .into_iter()
        .map(|word| match word.split_once('=') {
            Some((name, value)) => (name.to_string(), Some(value.to_string())),
            None => (word, None),
        })
        .collect()
}

/// Joins a shell-form command's continuation lines as Docker does: the
/// escape character and its newline go, and so do comment and empty lines
/// inside the command.
pub(crate) fn join_continuations(raw: &str, escape: char) -> String {
    let mut out = String::new();
    let mut continued = false;
    for (index, line) in raw.split('\n').enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if index > 0 && continued {
            let trimmed = line.trim_start();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
        } else if index > 0 {
            out.push('\n');
        }
        let body = line.trim_end_matches([' ', '\t']);
        match body.strip_suffix(escape) {
            Some(rest) => {
                out.push_str(rest);
                continued = true;
            }
            None => {
                out.push_str(line);
                continued = false;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_keep_quotes_and_escapes() {
        assert_eq!(split_words("a=1  b=\"x y\" c='p q'", '\\'), ["a=1", "b=\"x y\"", "c='p q'"]);
        assert_eq!(split_words("a=x\\ y b", '\\'), ["a=x\\ y", "b"]);
        assert_eq!(split_words("a=\"\" ''", '\\'), ["a=\"\"", "''"]);
        assert_eq!(split_words("a=\"q\\\" r\"", '\\'), ["a=\"q\\\" r\""]);
    }

    #[test]
    fn name_values_old_and_new_forms() {
        assert_eq!(
            name_values("A=1 B=\"two words\"", '\\').unwrap(),
            [("A".into(), "1".into()), ("B".into(), "\"two words\"".into())]
        );
        assert_eq!(
            name_values("PATH /usr/bin:/bin  and more", '\\').unwrap(),
            [("PATH".into(), "/usr/bin:/bin  and more".into())]
        );
        assert!(name_values("A=1 B", '\\').is_err());
        assert!(name_values("A", '\\').is_err());
    }

    #[test]
    fn continuations_join_without_comments() {
        let raw = "apt-get update && \\\n    # a comment\n\n    apt-get install -y curl \\  \n  && true";
        assert_eq!(join_continuations(raw, '\\'), "apt-get update &&     apt-get install -y curl   && true");
        assert_eq!(join_continuations("echo a`\n b", '`'), "echo a b");
        assert_eq!(join_continuations("echo a \\", '\\'), "echo a ");
    }
}
