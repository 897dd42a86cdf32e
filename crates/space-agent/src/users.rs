//! Looking users up in the sandbox's own `/etc/passwd`.

use std::fs;

/// The account a command runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// Resolves a user name or numeric uid, optionally with a group as images
/// give it (`user:group`, `1000:1000`); `None` means root.
pub fn resolve(user: Option<&str>) -> Result<Account, String> {
    let passwd = fs::read_to_string("/etc/passwd").unwrap_or_default();
    let Some((user, group)) = user.and_then(|u| u.split_once(':')) else {
        return resolve_in(&passwd, user.unwrap_or("root"));
    };
    let mut account = resolve_in(&passwd, user)?;
    account.gid = group_in(&fs::read_to_string("/etc/group").unwrap_or_default(), group)?;
    Ok(account)
}

/// The name of `uid` in `/etc/passwd`, else the number.
pub fn user_name(uid: u32) -> String {
    name_in(&fs::read_to_string("/etc/passwd").unwrap_or_default(), uid)
}

/// The name of `gid` in `/etc/group`, else the number.
pub fn group_name(gid: u32) -> String {
    name_in(&fs::read_to_string("/etc/group").unwrap_or_default(), gid)
}

/// The user and group tables read once, to name the owners of many paths
/// (a directory's listing).
pub struct Names {
    passwd: String,
    group: String,
}

impl Names {
    pub fn read() -> Names {
        Names {
            passwd: fs::read_to_string("/etc/passwd").unwrap_or_default(),
            group: fs::read_to_string("/etc/group").unwrap_or_default(),
        }
    }

    pub fn user(&self, uid: u32) -> String {
        name_in(&self.passwd, uid)
    }

    pub fn group(&self, gid: u32) -> String {
        name_in(&self.group, gid)
    }
}

/// The first name whose third field is `id`, in passwd or group text.
fn name_in(table: &str, id: u32) -> String {
    table
        .lines()
        .map(|line| line.split(':').collect::<Vec<_>>())
        .find(|fields| fields.len() >= 3 && fields[2].parse() == Ok(id))
        .map(|fields| fields[0].to_string())
        .unwrap_or_else(|| id.to_string())
}

/// A group name or numeric gid from `/etc/group`'s text.
fn group_in(groups: &str, group: &str) -> Result<u32, String> {
    if let Ok(gid) = group.parse() {
        return Ok(gid);
    }
    groups
        .lines()
        .map(|line| line.split(':').collect::<Vec<_>>())
        .find(|fields| fields.len() >= 3 && fields[0] == group)
        .and_then(|fields| fields[2].parse().ok())
        .ok_or_else(|| format!("no such group in the sandbox: {group}"))
}

fn resolve_in(passwd: &str, user: &str) -> Result<Account, String> {
    let numeric: Option<u32> = user.parse().ok();
    for line in passwd.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() < 7 {
            continue;
        }
        let (Ok(uid), Ok(gid)) = (fields[2].parse::<u32>(), fields[3].parse::<u32>()) else {
            continue;
        };
        if fields[0] == user || numeric == Some(uid) {
            return Ok(Account { name: fields[0].to_string(), uid, gid, home: fields[5].to_string() });
        }
    }
    match (numeric, user) {
        // A bare uid with no passwd entry is still a valid identity.
        (Some(uid), _) => Ok(Account { name: uid.to_string(), uid, gid: uid, home: "/".into() }),
        (None, "root") => Ok(Account { name: "root".into(), uid: 0, gid: 0, home: "/root".into() }),
        (None, name) => Err(format!("no such user in the sandbox: {name}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str =
        "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\nbroken\n";

    #[test]
    fn ids_are_named_from_the_tables_or_shown_as_numbers() {
        assert_eq!(name_in(PASSWD, 65534), "nobody");
        assert_eq!(name_in(PASSWD, 0), "root");
        assert_eq!(name_in(PASSWD, 1234), "1234");
    }

    #[test]
    fn names_and_uids_resolve() {
        assert_eq!(resolve_in(PASSWD, "nobody").unwrap().uid, 65534);
        assert_eq!(resolve_in(PASSWD, "0").unwrap().name, "root");
        assert_eq!(resolve_in(PASSWD, "1234").unwrap().gid, 1234);
        assert!(resolve_in(PASSWD, "mallory").is_err());
        assert_eq!(resolve_in("", "root").unwrap().home, "/root");
    }

    #[test]
    fn groups_resolve_by_name_or_number() {
        assert_eq!(group_in("staff:x:50:\n", "staff"), Ok(50));
        assert_eq!(group_in("", "1000"), Ok(1000));
        assert!(group_in("staff:x:50:\n", "wheel").is_err());
    }
}
